"""Secrets never land in a run directory, by name or by value.

By name: environment variables and script options named like a secret (``*TOKEN*``, ``*KEY*``,
``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``; ``--api-key X`` or ``--token=X``) keep their name and
lose their value. By value: credentials inside URLs (``scheme://user:password@host``), bearer
tokens (``Bearer ...``), and every value those secret names carried, wherever it shows up again
(an exception message, a stack, a command line). Applied to every record and file distdebug
writes, not only the manifest. Pure standard library; cheap when there is nothing to hide (a
substring test before any regular expression).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
REDACTED = "<redacted>"
MIN_VALUE_LEN = 6
"""Shorter secret values are not searched for by value: they would match ordinary text."""

_URL_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/\s:@\"']+:[^/\s@\"']+@")
_BEARER = re.compile(r"(\b(?:Bearer|Basic|Token)\s+)[A-Za-z0-9\-._~+/]{8,}=*", re.IGNORECASE)


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def secret_values(env: dict[str, str] | None = None, argv: Iterable[str] = ()) -> set[str]:
    """The values that secret-named variables and options carry (to be hidden wherever they appear)."""
    env = dict(os.environ) if env is None else env
    values = {v for k, v in env.items() if is_secret(k) and len(v) >= MIN_VALUE_LEN}
    args = list(argv)
    for i, arg in enumerate(args):
        if arg.startswith("-") and is_secret(arg.split("=", 1)[0]):
            value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            if len(value) >= MIN_VALUE_LEN:
                values.add(value)
    return values


def redact_text(text: str, values: Iterable[str] = ()) -> str:
    """text with URL credentials, bearer tokens and the given secret values replaced."""
    for value in values:
        if value in text:
            text = text.replace(value, REDACTED)
    if "://" in text and "@" in text:
        text = _URL_CREDENTIALS.sub(lambda m: m.group(1) + REDACTED + "@", text)
    lower = text.lower()
    if "bearer" in lower or "basic" in lower or "token" in lower:
        text = _BEARER.sub(lambda m: m.group(1) + REDACTED, text)
    return text


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Copy of env: secret-named values replaced (names kept: they help), other values redacted by value."""
    values = secret_values(env)
    return {k: (REDACTED if is_secret(k) else redact_text(v, values)) for k, v in sorted(env.items())}


def redact_argv(argv: list[str]) -> list[str]:
    """``--api-key X`` / ``--token=X`` lose their values; URLs and tokens inside any argument too."""
    values = secret_values({}, argv) | secret_values()
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if arg.startswith("-") and is_secret(arg.split("=", 1)[0]):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(redact_text(arg, values))
    return out


class Redactor:
    """The secrets of this process (its environment and command line), applied to text it writes."""

    def __init__(self, env: dict[str, str] | None = None, argv: Iterable[str] | None = None) -> None:
        import sys

        self.values = sorted(secret_values(env, sys.argv if argv is None else argv), key=len, reverse=True)

    def __call__(self, text: str) -> str:
        return redact_text(text, self.values)
