"""JSON that every parser reads: a number that is not finite is written as the string "NaN", "Infinity" or
"-Infinity".

Why: Python's ``json`` writes bare ``NaN`` and ``Infinity``, which are not JSON: a browser's ``JSON.parse``, ``jq``
and most readers outside Python reject the whole document, and a run with a NaN is exactly the run a user pipes
into them. Strings rather than ``null`` keep a NaN apart from an Inf and from a value that is missing; the HTML
report's page already wrote them so (its reviver turns them back). distdebug's own readers turn them back with
``loads``: a string value that is exactly one of the three is read as the number (no name or message of
distdebug's is one of them).

``dumps`` and ``loads`` take ``json``'s arguments. A document with no such number costs what ``json`` costs (the
encoder refuses one, and only then is the document walked); ``loads`` walks only a text that holds one.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_MARKS = ('"NaN"', 'Infinity"')
_BMARKS = (b'"NaN"', b'Infinity"')


@functools.lru_cache(maxsize=16)
def _encoder(indent: int | None, separators: tuple[str, str] | None, default: Any, sort_keys: bool
             ) -> json.JSONEncoder:
    return json.JSONEncoder(allow_nan=False, indent=indent, separators=separators, default=default,
                            sort_keys=sort_keys)


def finite(x: Any) -> Any:
    """``x`` with every float that is not finite replaced by its string (dicts, lists and tuples walked)."""
    if isinstance(x, float):
        if math.isfinite(x):
            return x
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def dumps(obj: Any, *, indent: int | None = None, separators: tuple[str, str] | None = None,
          default: Any = None, sort_keys: bool = False) -> str:
    """``json.dumps`` whose output is strict JSON (non-finite numbers as strings)."""
    enc = _encoder(indent, separators, default, sort_keys)
    try:
        return enc.encode(obj)
    except ValueError as e:
        if "Out of range float" not in str(e):
            raise
        if default is not None:  # what ``default`` turns an object into may hold a non-finite number too
            obj = json.loads(json.JSONEncoder(default=default).encode(obj))
        return enc.encode(finite(obj))


def revive(x: Any) -> Any:
    """The inverse of ``finite``: the three strings back to numbers."""
    if isinstance(x, str):
        return NONFINITE.get(x, x)
    if isinstance(x, dict):
        return {k: revive(v) for k, v in x.items()}
    if isinstance(x, list):
        return [revive(v) for v in x]
    return x


def loads(text: str | bytes) -> Any:
    """``json.loads`` of what ``dumps`` wrote (and of Python's own bare NaN, as before), numbers revived."""
    out = json.loads(text)
    marks: Any = _BMARKS if isinstance(text, bytes) else _MARKS
    return revive(out) if any(m in text for m in marks) else out


def strict_loads(text: str | bytes) -> Any:
    """A strict parser, as a browser's or jq's: bare NaN/Infinity refused (ValueError). For the tests."""

    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)
