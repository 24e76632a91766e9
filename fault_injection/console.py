"""The terminal side of ``distdebug faults``: the catalogue and the replay matrix (rich lives here)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .matrix import Cell
from .registry import FAULTS

if TYPE_CHECKING:
    from .sandbox import Isolation

STYLE = {"caught-localised": "green", "clean": "green", "caught": "yellow", "miss": "red", "false-alarm": "red",
         "error": "red", "not-applicable": "dim", "did-not-act": "magenta"}


def catalogue(console: Any) -> None:
    from rich.table import Table

    t = Table(title="faults (distdebug attach --inject NAME[:KEY=VALUE,...])", show_lines=False)
    for col in ("fault", "what it does", "parameters (default)", "caught by", "replayed on"):
        t.add_column(col, no_wrap=col in ("fault", "caught by"))
    for name, cls in FAULTS.items():
        params = ", ".join(f"{p.name}={p.default}" for p in cls.params) or "-"
        t.add_row(name, cls.description, params, cls.catcher, ", ".join(cls.engines))
    console.print(t)


def matrix(console: Any, cells: list[Cell]) -> None:
    from rich.markup import escape as esc
    from rich.table import Table

    t = Table(title="fault replay: fault x engine")
    for col in ("fault", "engine", "result", "detector", "steps to detection", "wall s", "why"):
        t.add_column(col, no_wrap=col in ("fault", "engine", "result"))
    for c in cells:
        t.add_row(c.fault, c.engine, f"[{STYLE.get(c.status, 'white')}]{c.status}[/]", c.detector or "-",
                  "-" if c.steps_to_detection is None else str(c.steps_to_detection), f"{c.wall_s:.1f}",
                  esc(c.reason or ""))
    console.print(t)
    console.print(summary(cells))


def summary(cells: list[Cell]) -> str:
    """The replay's last line: what could act, what was caught, what did not act when run (said only when one
    did not: the fault's own reason is in its row), what could not act, the clean runs, failures."""
    faults = [c for c in cells if c.fault != "clean"]
    cleans = [c for c in cells if c.fault == "clean"]
    applicable = [c for c in faults if c.applicable]
    caught = sum(c.status == "caught-localised" for c in applicable)
    silent = sum(c.status == "did-not-act" for c in applicable)
    bad = [c for c in cells if not c.ok]
    line = (f"{len(applicable)} applicable, {caught} caught-localised, "
            + (f"{silent} did not act, " if silent else "")
            + f"{len(faults) - len(applicable)} not applicable; "
            f"{sum(c.status == 'clean' for c in cleans)} of {len(cleans)} clean runs clean; ")
    return line + (f"{len(bad)} failed: " + ", ".join(f"{c.fault}/{c.engine} ({c.status})" for c in bad)
                   if bad else "0 failed")


def isolation(iso: Isolation) -> tuple[list[str], list[str]]:
    """What a script replay isolated (fault_injection.sandbox), as (lines for the console before the matrix,
    warnings: a user's file a run changed through a link, a path that could not be put back)."""
    snap = iso.snapshot
    copied = snap.copied
    line = (f"each run started from a copy of {snap.source} ({len(copied)} file{'s' * (len(copied) != 1)}, "
            f"{_size(sum(e.size for e in copied))}")
    linked = _linked(snap.linked)
    lines = [line + (f"; linked, not copied: {linked})" if linked else ")")]
    if iso.saved:
        said = ", ".join(f"{s.path} ({_how(s)})" for s in iso.saved)
        serial = (f"; the runs went one at a time (not -j {iso.serial_from}): they all write there"
                  if iso.serial_from else "")
        lines.append(f"restored between runs: {said}{serial}")
    elif iso.serial_from:
        lines.append(f"the runs went one at a time (not -j {iso.serial_from}): the clean run wrote through a link "
                     "to your file")
    warnings = [f"warning: the run {run} changed {snap.source / e.rel} through its link to your file (linked, "
                f"not copied: {_WHY[e.why]}); the replay cannot undo it" for run, e in iso.changed]
    warnings += [f"warning: {p}; what was there is kept in {iso.backups}" for p in iso.problems]
    if iso.kept is not None and not iso.problems:
        warnings.append(f"warning: not every path the clean run saved to outside could be put back; what was "
                        f"there is kept in {iso.kept}")
    return lines, warnings


_WHY = {"big": "bigger than the size copied per file", "budget": "past the bytes copied per run",
        "many": "a folder of many entries", "folder": "a folder a script only reads", "other": "not a regular file"}


def _linked(entries: list[Any], most: int = 6) -> str:
    """The linked entries by their top folder: ``data/ (2 files, 3.2 GB)``, ``.git/``, ``big.bin (80.0 MB)``."""
    groups: dict[str, list[Any]] = {}
    for e in entries:
        groups.setdefault(e.rel.split("/", 1)[0], []).append(e)
    said = []
    for top, group in sorted(groups.items()):
        if len(group) == 1 and group[0].rel == top:
            said.append(f"{top}/" if group[0].folder else f"{top} ({_size(group[0].size)})")
            continue
        files = [e for e in group if e.why in ("big", "budget")]
        rest = len(group) - len(files)
        parts = [f"{len(files)} file{'s' * (len(files) != 1)}, {_size(sum(e.size for e in files))}"] if files else []
        parts += [f"{rest} other entr{'ies' if rest != 1 else 'y'}"] if rest else []
        said.append(f"{top}/ ({'; '.join(parts)})")
    more = len(said) - most
    return ", ".join(said[:most]) + (f" and {more} more" if more > 0 else "")


def _how(s: Any) -> str:
    """What the clean run did to a path outside the copy (a sandbox.Saved), and what the replay did about it."""
    if s.existed is False:
        return "created by the clean run"
    if s.existed and s.backup is not None:
        return "overwritten by the clean run, put back"
    if s.existed:
        return "overwritten by the clean run; its original could not be kept: not restorable"
    if s.backup is not None:
        return "its copy was cut short: not restorable, what was copied kept"
    return "written through a file the script opened itself: not restorable"


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
