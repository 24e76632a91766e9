"""The launcher's side services while the ranks run, each in its own room behind start and stop.

Why a list: attach started four of them inline (the supervisor, which watches the ranks for a hang; the
log-volume guard; the status line on a terminal; the relay of ``distdebug stacks``' requests), each with its own
rules for failing, in the middle of the launch. Here each is made by one function, they start in order before
the ranks and stop in the reverse order after them, whatever ended the job, and one that fails to start or stop
is said in one line and never costs the job (the supervisor excepted: without it a hang would go unjudged, so it
is not optional).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from distdebug.config import AttachConfig, parse_nnodes
from distdebug.launch import supervisor as supervisor_mod

if TYPE_CHECKING:
    from distdebug.launch.volume import VolumeGuard


class Service(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


def _say(what: str, e: BaseException) -> None:
    print(f"distdebug: {what} ({type(e).__name__}: {e})", file=sys.stderr, flush=True)


def volume_guard(cfg: AttachConfig, run_dir: Path, log_dir: str | None) -> VolumeGuard | None:
    """What the job will write an hour, against free space (launch.volume); off, said, if it cannot be made."""
    from distdebug.launch.volume import VolumeGuard

    try:
        return VolumeGuard(run_dir, budget=cfg.run_dir_budget, expected=cfg.expected_hours, log_dir=log_dir,
                           node_rank=cfg.node_rank)
    except Exception as e:  # the guard is never worth a job
        _say("log-volume guard off", e)
        return None


@dataclass
class Services:
    """The side services of one launch: ``supervisor`` (its verdict is read after the job), ``guard`` (its
    summary too), and every service in start order. A context: started on entry, stopped on exit."""

    supervisor: supervisor_mod.Supervisor
    guard: VolumeGuard | None
    order: list[Service] = field(default_factory=list)
    started: list[Service] = field(default_factory=list)

    @classmethod
    def for_launch(cls, cfg: AttachConfig, run_dir: Path, log_dir: str | None) -> Services:
        from distdebug.launch.relay import StacksRelay
        from distdebug.launch.status import StatusLine

        guard = volume_guard(cfg, run_dir, log_dir)
        supervisor = supervisor_mod.Supervisor(
            run_dir, stall_timeout=cfg.stall_timeout, startup_timeout=cfg.startup_allowance, on_hang=cfg.on_hang,
            node_rank=cfg.node_rank, expected_nodes=parse_nnodes(cfg.nnodes)[0], on_stall=cfg.on_stall,
            guard=guard)
        status = StatusLine(run_dir, cfg.node_rank) if StatusLine.wanted() else None
        # the relay before the ranks start: they find their wake-up folder in the environment
        relay = StacksRelay(run_dir)
        return cls(supervisor, guard, [s for s in (supervisor, status, relay) if s is not None])

    def __enter__(self) -> Services:
        for service in self.order:
            if service is self.supervisor:
                service.start()  # not optional: raises, and the job does not start unwatched
            else:
                try:
                    service.start()
                except Exception as e:
                    _say(f"{type(service).__name__} off", e)
                    continue
            self.started.append(service)
        return self

    def __exit__(self, *exc: Any) -> None:
        for service in reversed(self.started):
            try:
                service.stop()
            except Exception as e:  # the others are still stopped
                _say(f"could not stop {type(service).__name__}", e)
        self.started = []
