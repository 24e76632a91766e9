"""The terminal side of ``distdebug faults``: the catalogue and the replay matrix (rich lives here)."""

from __future__ import annotations

from typing import Any

from .matrix import Cell
from .registry import FAULTS

STYLE = {"caught-localised": "green", "clean": "green", "caught": "yellow", "miss": "red", "false-alarm": "red",
         "error": "red", "not-applicable": "dim"}


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
    """The replay's last line: what could act, what was caught, what could not act, the clean runs, failures."""
    faults = [c for c in cells if c.fault != "clean"]
    cleans = [c for c in cells if c.fault == "clean"]
    applicable = [c for c in faults if c.applicable]
    caught = sum(c.status == "caught-localised" for c in applicable)
    bad = [c for c in cells if not c.ok]
    line = (f"{len(applicable)} applicable, {caught} caught-localised, {len(faults) - len(applicable)} not applicable; "
            f"{sum(c.status == 'clean' for c in cleans)} of {len(cleans)} clean runs clean; ")
    return line + (f"{len(bad)} failed: " + ", ".join(f"{c.fault}/{c.engine} ({c.status})" for c in bad)
                   if bad else "0 failed")
