"""``distdebug top``'s table (rich): a row per rank, refreshed in place (rich Live) while the job runs, or
printed once (a finished run, --once, stdout not a terminal)."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from distdebug.analysis.live import Follower, RankLive, running, slowest, snapshot_rows
from distdebug.report.console import SEVERITY_STYLE
from distdebug.report.fmt import number


def table(ranks: dict[int, RankLive], dirs: list[Path]) -> Table:
    state = "running" if running(ranks, dirs) else "ended"
    slow = slowest(list(ranks.values()))
    t = Table(title=f"distdebug top ({len(ranks)} ranks, {state})", caption=", ".join(str(d) for d in dirs))
    for col in ("rank", "node", "step", "steps/s", "loss", "step ms", "findings", "status", "last record"):
        t.add_column(col, justify="right" if col not in ("status", "findings") else "left")
    for row in snapshot_rows(ranks):
        worst = row["worst"]
        found = str(row["findings"]) + (f" [{SEVERITY_STYLE[worst]}]({worst})[/]" if worst else "")
        ago = "-" if row["last_record_s_ago"] is None else f"{row['last_record_s_ago']:.0f} s ago"
        rank = f"[bold]{row['rank']}[/bold] (slowest)" if slow is not None and slow.rank == row["rank"] else \
            str(row["rank"])
        t.add_row(rank, "-" if row["node"] is None else str(row["node"]), str(row["step"]),
                  number(row["steps_per_s"], 3), number(row["loss"]), number(row["step_time_ms"], 3), found,
                  row["status"], ago)
    return t


def show(follower: Follower, dirs: list[Path], *, live: bool, interval: float = 1.0,
         console: Console | None = None) -> None:
    # Piped output defaults to 80 columns, which folds every row (as the report's console does).
    console = console or Console(width=None if Console().is_terminal else 140)
    ranks = follower.poll()
    if not live or not running(ranks, dirs):
        console.print(table(ranks, dirs))
        return
    try:
        with Live(table(ranks, dirs), console=console, refresh_per_second=max(1.0, 1 / interval)) as view:
            while running(ranks, dirs):
                time.sleep(interval)
                ranks = follower.poll()
                view.update(table(ranks, dirs))
    except KeyboardInterrupt:
        pass
