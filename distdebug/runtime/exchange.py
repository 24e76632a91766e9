"""A detector's cross-rank exchange that never blocks training.

Why a thread: a harness collective on the training thread waits for every peer. When ranks are out
of step (one skipped a collective, one is stuck), that wait turns the script's own hang into a
deadlock inside distdebug, and the hang diagnosis then points at the harness. Here the training
thread only queues a payload; a background thread runs ``all_gather_object`` on a gloo group of
the harness's own (hang analysis leaves that group out) and hands the gathered payloads to a
callback, which reports findings through ``ctx.report`` (thread-safe).

Every rank queues the same exchanges in the same order (detectors choose them by step number), so
they pair up. At a clean end (the script destroys its process group, every rank together) the
queue is drained; at any other end the rank does not wait for peers that may never come.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

from distdebug.context import RankContext

HARNESS_GROUP_DESC = "distdebug_harness"
"""Description of the harness's own process groups; hang analysis leaves their collectives out."""
DRAIN_TIMEOUT_S = 10.0
CHECK_EVERY = 16


def checked_step(step: int) -> bool:
    """The steps at which the periodic checks exchange: early ones (2, 4, 8), then every CHECK_EVERY."""
    return step in (2, 4, 8) or step % CHECK_EVERY == 0


class BackgroundExchange:
    def __init__(self, ctx: RankContext, name: str, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        self.ctx = ctx
        self.name = name
        self.group: Any = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s),
                                         group_desc=HARNESS_GROUP_DESC)
        self.world = dist.get_world_size(self.group)
        self._queue: queue.Queue = queue.Queue(maxsize=64)
        self._thread = threading.Thread(target=self._worker, name=f"distdebug-{name}", daemon=True)
        self._thread.start()

    def post(self, payload: Any, callback: Callable[[list[Any]], None]) -> bool:
        """Queue one exchange; False (and nothing queued) if the exchange has stopped or fallen behind."""
        if self.group is None:
            return False
        try:
            self._queue.put_nowait((payload, callback))
            return True
        except queue.Full:
            return False

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            payload, callback = item
            if self.group is None:
                continue
            try:
                gathered: list[Any] = [None] * self.world
                self.ctx.raw_collectives["all_gather_object"](gathered, payload, group=self.group)
                callback(gathered)
            except Exception as e:  # a peer that left, a destroyed group: stop, never raise
                self.group = None
                from distdebug.findings import Finding, Severity

                self.ctx.report(Finding(
                    severity=Severity.INFO, detector="harness", ranks=[self.ctx.rank], step=None,
                    subject=f"detector:{self.name}",
                    message=f"cross-rank exchange failed ({type(e).__name__}: {str(e)[:200]}); stopped on this rank",
                ))

    def close(self, clean: bool) -> None:
        """clean: every rank is ending together; drain, then release the group. Otherwise do not wait."""
        import torch.distributed as dist

        if self._thread is None:
            return
        self._queue.put(None)
        # Not clean: peers that are ending too still pair up in a moment; ones that are not never will.
        self._thread.join(timeout=DRAIN_TIMEOUT_S if clean else 2.0)
        busy = self._thread.is_alive()
        self._thread = None  # type: ignore[assignment]
        group, self.group = self.group, None
        if group is not None and not busy and dist.is_initialized():
            dist.distributed_c10d.destroy_process_group(group)


class ExchangeUser:
    """Mixin for detectors with a ``BackgroundExchange`` in ``self.exchange``: drained at a clean end.

    A detector that sets ``last_step`` in ``on_step`` and overrides ``flush_pending`` also gets what
    it gathered since its last checked step exchanged at a clean end. Whether to flush depends on
    the step number only, which every rank shares, so the exchanges still pair up.
    """

    exchange: BackgroundExchange | None = None
    last_step: int = 0

    def open_exchange(self, ctx: RankContext) -> bool:
        """Start this detector's exchange when there are peers to exchange with (a process group of 2+)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        self.exchange = BackgroundExchange(ctx, getattr(self, "name", "exchange"))
        return True

    def flush_pending(self) -> None:
        """Post what was gathered since the last checked step (override)."""

    def before_destroy(self) -> None:
        if self.exchange is not None and self.last_step and not checked_step(self.last_step):
            self.flush_pending()
        self.close_exchange(clean=True)

    def close_exchange(self, clean: bool) -> None:
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.close(clean)
