"""The rank's progress record: what the training thread last did, for the watchdog thread to read.

Written on the training thread with plain attribute stores (no lock on the hot path: a reader that
sees a value one store old is still right about a stall measured in seconds); read by
``runtime.watchdog`` through this record alone, never through the session's internals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Progress:
    last: float = field(default_factory=time.monotonic)
    """time.monotonic() of the last sign of progress: a step boundary, a collective that returned,
    init_process_group entered or left."""
    phase: str = "startup"
    """startup -> init_process_group -> training."""
    step: int = 0
    """Optimizer steps completed on this rank."""
    collective_seq: int = 0
    """Python-level collectives this rank has entered (point-to-point operations apart)."""
    p2p_seq: int = 0
    """Point-to-point operations (send, recv, isend, irecv) this rank has entered: numbered apart, since
    pipeline stages issue different numbers of them by design."""
    in_collective: dict[str, Any] | None = None
    """The collective the training thread is inside now (op, seq, step, shapes, since), or None."""

    def touch(self) -> None:
        self.last = time.monotonic()
