"""What the mechanisms of checkpoint_roundtrip share: this rank's saves and loads so far (behind one lock:
a framework may save from a thread of its own), and the wrapping that never lets a check of ours break
the user's save or load (``check_safely``).

Why a module of its own: saves.py, loads.py, pretrained.py and shards.py are each a class over these
fields, composed by ``CheckpointRoundTrip`` (the package); declared once so each reads on its own."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from distdebug import strictjson
from distdebug.artifacts import layout
from distdebug.artifacts.writer import os_error_text
from distdebug.context import RankContext
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.runtime.imports import ImportHook


class RoundTripState(Detector):
    """The fields, the patching helper and the guard every mechanism uses (``check_safely``)."""

    def __init__(self) -> None:
        self.ctx: RankContext | None = None
        self.step = 0
        self.saved: dict[str, dict[str, Any]] = {}  # abs path -> {"fps", "step"} saved by this rank
        self._loaded: set[str] = set()
        self._reported: set[tuple[str, tuple[str, ...]]] = set()
        self._foreign: list[dict[str, Any]] = []  # restores of another rank's sibling file, judged later
        self._hooks: list[ImportHook] = []
        self._buffers: list[dict[str, Any]] = []  # this rank's latest saves into buffers: {"fps", "step", "rank"}
        self._restore: list[tuple[Any, str, Any]] = []  # patched outside Detector.patch (a classmethod)
        self._others: tuple[int, list[dict[str, Any]]] = (-1, [])  # (step read at, the other ranks' buffer saves)
        self._lock = threading.Lock()
        self._records_lost = False  # the run directory took no more records (append_record)

    def _patch(self, obj: Any, name: str, wrapper: Any) -> None:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        self.patch(ctx, obj, name, wrapper)

    def check_safely(self, fn: Any, obj: Any, f: Any) -> None:
        """Run a check of a save or load: an exception of ours is a harness finding, never the user's."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        try:
            fn(obj, f)
        except Exception as e:  # never break the user's save or load
            ctx.report(Finding(
                severity=Severity.INFO, detector="harness", ranks=[ctx.rank], step=self.step or None,
                subject=f"detector:{self.name}", message=f"could not check {f}: {type(e).__name__}: {e}",
            ))

    def append_record(self, record: dict[str, Any]) -> None:
        """One save's record in this rank's checkpoints.jsonl (one write: a cut line is skipped by its readers).
        A full or failing disk stops the records, said once: this job's own restores are still checked (from
        memory); a later job's restore of these saves is not."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        records = self._records_path(ctx.rank)
        if records is None or self._records_lost:
            return
        try:
            records.parent.mkdir(parents=True, exist_ok=True)
            with open(records, "a") as out:
                out.write(strictjson.dumps(record) + "\n")
        except OSError as e:
            self._records_lost = True
            ctx.report(Finding(
                severity=Severity.INFO, detector="harness", ranks=[ctx.rank], step=self.step or None,
                subject="checkpoint records",
                message=f"could not record checkpoint saves in the run directory ({os_error_text(e)}): restores in "
                        "this job are still checked; a later job's restore of these saves cannot be"))

    def _records_path(self, rank: int) -> Path | None:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        return layout.checkpoints_path(ctx.run_dir, rank) if ctx.run_dir is not None else None
