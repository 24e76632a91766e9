"""``distdebug diff``: the rich rendering of ``analysis.diff``'s results (plain dicts, as --json prints)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


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
        if result.get("thinned"):
            console.print("  (a thinned step: the digests of all its tensors agree; each tensor's fingerprint was "
                          "not kept past the run-directory budget's ring)")
            for ranks in result.get("not_compared") or []:
                console.print(f"  [yellow]compared only among themselves[/yellow]: ranks {ranks} digested other "
                              "tensors than the largest group (a replica group's own, or a tensor missing there): "
                              "a thinned step cannot compare across such groups")
        return
    if result.get("thinned"):
        t = result["tensors"][0]
        console.print(f"[bold red]Replicas differ at step {result['step']}[/bold red], a step thinned past the "
                      "run-directory budget's ring: only the digest of all its tensors was kept, so which tensor "
                      "differs is not known.\n  ranks grouped by equal digest: "
                      + "  ".join("{" + ",".join(map(str, g)) + "}" for g in t["groups"])
                      + (f"; odd rank(s): {','.join(map(str, t['ranks']))}" if t["by_majority"] else ""))
        return
    table = Table(title=f"Replicas differ at step {result['step']} ({len(result['tensors'])} tensors)")
    for col in ("tensor", "odd rank(s)", "ranks grouped by equal fingerprint"):
        table.add_column(col, overflow="fold")
    for t in result["tensors"][:200]:
        odd = ",".join(map(str, t["ranks"])) + ("" if t["by_majority"] else " (no majority)")
        name = t["tensor"] + (f" (replicas {t['replica_group']})" if t.get("replica_group") else "")
        table.add_row(name, odd, "  ".join("{" + ",".join(map(str, g)) + "}" for g in t["groups"]))
    console.print(table)
