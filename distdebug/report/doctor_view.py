"""Terminal view of ``distdebug doctor``'s result (rich lives in report/)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape as esc
from rich.table import Table

STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


def render(console: Console, result: dict[str, Any]) -> None:
    ranks = result.get("ranks") or {}
    # One row per check: its status on the first rank, and which ranks differ from it.
    rows: dict[str, dict[str, Any]] = {}
    for rank, r in ranks.items():
        for c in r.get("checks", []):
            row = rows.setdefault(c["name"], {"check": c, "other": []})
            if c["status"] != row["check"]["status"] or c["detail"] != row["check"]["detail"]:
                row["other"].append(rank)
    title = "distdebug doctor" + (f" ({len(ranks)} ranks)" if "local" not in ranks else " (this host)")
    table = Table(title=title)
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    for name, row in rows.items():
        c = row["check"]
        differs = f" [dim](differs on ranks {', '.join(row['other'])})[/dim]" if row["other"] else ""
        detail = esc(c["detail"]) + differs
        table.add_row(esc(name), f"[{STYLE[c['status']]}]{c['status']}[/]", detail, esc(c.get("fix", "")))
    console.print(table)
    for d in result.get("differences", []):
        console.print(f"[yellow]differs across ranks[/yellow]: {esc(d['name'])}: " +
                      esc("; ".join(f"{v!r} on ranks {rs}" for v, rs in d["values"].items())))
    sweep = result.get("all_reduce")
    if sweep:
        t = Table(title=f"all_reduce bus bandwidth ({result.get('backend')}, {result.get('world_size')} ranks)")
        for col in ("size (B)", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
            t.add_column(col, justify="right")
        for row in sweep:
            t.add_row(str(row["bytes"]), f"{row['time_us']:.1f}", f"{row['algbw_GBps']:.3f}",
                      f"{row['busbw_GBps']:.3f}")
        console.print(t)
    links = result.get("links")
    if links:
        n = int(result.get("world_size") or 0)
        t = Table(title="link matrix: send/recv bandwidth GB/s (latency us)")
        t.add_column("rank")
        for b in range(n):
            t.add_column(str(b), justify="right")
        for a in range(n):
            cells = []
            for b in range(n):
                key = f"{min(a, b)}-{max(a, b)}"
                cells.append("-" if a == b else f"{links['bandwidth_GBps'].get(key, 0):.3g} "
                                                f"({links['latency_us'].get(key, 0):.0f})")
            t.add_row(str(a), *cells)
        console.print(t)
    if result.get("run_dir"):
        console.print(f"records: {result['run_dir']} (distdebug report {result['run_dir']})")
