"""``distdebug diff``: results as plain dicts (for --json) and their rich rendering."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from distdebug.analysis import diff as diff_mod
from distdebug.errors import UserError


def ranks(run_dir: Path, step: int | None) -> dict[str, Any]:
    snaps = diff_mod.load_snapshots(run_dir)
    steps = diff_mod.steps_of(snaps)
    if step is not None:
        if step not in steps:
            raise UserError(f"step {step} was not checked in {run_dir}; checked steps: {_span(steps)}")
        diffs = diff_mod.diff_step(snaps, step)
        found_step = step if diffs else None
    else:
        first = diff_mod.first_divergent_step(snaps)
        found_step, diffs = first if first else (None, [])
    return {
        "mode": "ranks", "run": str(run_dir), "ranks": sorted(snaps), "checked_steps": _span(steps),
        "step": step if step is not None else found_step, "identical": not diffs,
        "tensors": [d.to_dict() for d in diffs],
    }


def runs(a: Path, b: Path) -> dict[str, Any]:
    sa, sb = diff_mod.load_snapshots(a), diff_mod.load_snapshots(b)
    found, compared = diff_mod.diff_runs(sa, sb)
    if compared == 0:
        raise UserError(f"{a} and {b} share no checked (rank, step): nothing to compare")
    return {
        "mode": "runs", "run_a": str(a), "run_b": str(b), "compared": compared, "identical": found is None,
        "step": found.step if found else None, "rank": found.rank if found else None,
        "tensors": [{"tensor": t} for t in (found.tensors if found else [])],
    }


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]} ({len(steps)})" if steps else "none"


def render(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console(width=None if Console().is_terminal else 140)
    if result["mode"] == "runs":
        if result["identical"]:
            console.print(f"[green]bitwise identical[/green]: {result['compared']} (rank, step) fingerprint sets "
                          f"agree between\n  {result['run_a']}\n  {result['run_b']}")
            return
        console.print(f"[bold red]runs differ[/bold red] first at step {result['step']} on rank {result['rank']}: "
                      f"{len(result['tensors'])} tensor(s)")
        for t in result["tensors"][:20]:
            console.print(f"  {t['tensor']}")
        return
    if result["identical"]:
        where = f"at step {result['step']}" if result["step"] is not None else f"at every checked step " \
                f"({result['checked_steps']})"
        console.print(f"[green]replicas identical[/green] {where} across ranks {result['ranks']}")
        return
    table = Table(title=f"Replicas differ at step {result['step']} ({len(result['tensors'])} tensors)")
    for col in ("tensor", "odd rank(s)", "ranks grouped by equal fingerprint"):
        table.add_column(col, overflow="fold")
    for t in result["tensors"][:200]:
        odd = ",".join(map(str, t["ranks"])) + ("" if t["by_majority"] else " (no majority)")
        name = t["tensor"] + (f" (replicas {t['replica_group']})" if t.get("replica_group") else "")
        table.add_row(name, odd, "  ".join("{" + ",".join(map(str, g)) + "}" for g in t["groups"]))
    console.print(table)
