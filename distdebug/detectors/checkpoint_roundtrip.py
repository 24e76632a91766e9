"""CheckpointRoundTrip: what a ``torch.load`` restores must be what ``torch.save`` wrote.

``torch.save`` and ``torch.load`` are wrapped from the start of the script (restores usually happen
before the first step). At save, every tensor in the object (state dicts, optimizer state, nested
dicts and lists) is fingerprinted under its key path and recorded in this rank's
``rank-N/checkpoints.jsonl``. At load of a path saved earlier in this run, the loaded tensors are
fingerprinted and compared: a tensor that differs, is missing or is extra is a finding naming it.
A rank that saved a file of its own but restores one another rank saved (a sharded checkpoint
restored from the wrong shard) is a finding too; loading rank 0's file everywhere, as replicated
training does, is not.

Only paths (str / PathLike) are tracked; file objects and buffers pass through untouched.
DCP and DeepSpeed's ``save_checkpoint`` are not covered yet.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from distdebug.artifacts import layout
from distdebug.detectors.base import Detector, Finding, Severity, StepEvent
from distdebug.fingerprint.hashing import fingerprints

RECORDS = "checkpoints.jsonl"


def tensor_items(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(key path, tensor) for every tensor in nested dicts / lists / tuples, in a stable order."""
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, torch.Tensor):
        out.append((prefix or "<tensor>", obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.extend(tensor_items(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.extend(tensor_items(v, f"{prefix}[{i}]"))
    return out


def compare_saved(saved: dict[str, int], loaded: dict[str, int]) -> dict[str, list[str]]:
    return {
        "differ": [k for k in saved if k in loaded and saved[k] != loaded[k]],
        "missing": [k for k in saved if k not in loaded],
        "extra": [k for k in loaded if k not in saved],
    }


class CheckpointRoundTrip(Detector):
    name = "checkpoint_roundtrip"
    description = "a torch.load restores other tensors than torch.save wrote (names them), or another rank's shard"

    def __init__(self) -> None:
        self.ctx: Any = None
        self.step = 0
        self.saved: dict[str, dict[str, Any]] = {}  # abs path -> {"fps", "step"} saved by this rank
        self._lock = threading.Lock()

    def setup(self, ctx: Any) -> None:
        self.ctx = ctx
        self._patch("save", self._wrap_save)
        self._patch("load", self._wrap_load)

    def _patch(self, name: str, wrapper: Any) -> None:
        original = getattr(torch, name)
        self.ctx.patch(torch, name, wrapper(original))

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        self.step = event.step
        return ()

    # ------------------------------------------------------------------ save / load
    def _wrap_save(self, original: Any) -> Any:
        det = self

        @functools.wraps(original)
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(obj, f, *args, **kwargs)
            if isinstance(f, (str, os.PathLike)):
                det._guard(det._record_save, obj, f)
            return result

        return save

    def _wrap_load(self, original: Any) -> Any:
        det = self

        @functools.wraps(original)
        def load(f: Any, *args: Any, **kwargs: Any) -> Any:
            obj = original(f, *args, **kwargs)
            if isinstance(f, (str, os.PathLike)):
                det._guard(det._check_load, obj, f)
            return obj

        return load

    def _guard(self, fn: Any, obj: Any, f: Any) -> None:
        try:
            fn(obj, f)
        except Exception as e:  # never break the user's save or load
            self.ctx.report(Finding(
                severity=Severity.INFO, detector="harness", ranks=[self.ctx.rank], step=self.step or None,
                subject=f"detector:{self.name}", message=f"could not check {f}: {type(e).__name__}: {e}",
            ))

    def _records_path(self, rank: int) -> Path | None:
        return layout.rank_dir(self.ctx.run_dir, rank) / RECORDS if self.ctx.run_dir is not None else None

    def _record_save(self, obj: Any, f: Any) -> None:
        path = str(Path(f).resolve())
        fps = fingerprints(tensor_items(obj))
        with self._lock:
            self.saved[path] = {"fps": fps, "step": self.step}
        records = self._records_path(self.ctx.rank)
        if records is not None:
            records.parent.mkdir(parents=True, exist_ok=True)
            with open(records, "a") as out:
                out.write(json.dumps({"v": 1, "op": "save", "path": path, "step": self.step,
                                      "rank": self.ctx.rank, "fps": {k: f"{v:016x}" for k, v in fps.items()}}) + "\n")

    def _saved_by_others(self, path: str) -> tuple[int, dict[str, int]] | None:
        if self.ctx.run_dir is None:
            return None
        for rank_dir in sorted(Path(self.ctx.run_dir).glob("rank-*")):
            rank = layout.rank_of_dir(rank_dir.name)
            if rank is None or rank == self.ctx.rank or not (rank_dir / RECORDS).exists():
                continue
            found = None
            for line in (rank_dir / RECORDS).read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("path") == path:
                    found = (rank, {k: int(v, 16) for k, v in rec["fps"].items()})
            if found:
                return found
        return None

    def _check_load(self, obj: Any, f: Any) -> None:
        path = str(Path(f).resolve())
        with self._lock:
            mine = self.saved.get(path)
        other = None if mine is not None else self._saved_by_others(path)
        if mine is None and other is None:
            return  # not saved in this run: nothing to compare with
        loaded = fingerprints(tensor_items(obj))
        saved = mine["fps"] if mine is not None else other[1]  # type: ignore[index]
        diff = compare_saved(saved, loaded)
        rank = self.ctx.rank
        if any(diff.values()):
            names = diff["differ"] + diff["missing"] + diff["extra"]
            parts = [f"{len(v)} {k}" for k, v in diff.items() if v]
            self.ctx.report(Finding(
                severity=Severity.ERROR, detector=self.name, ranks=[rank], step=self.step or None,
                subject=names[0],
                message=f"restored {Path(path).name} does not match what was saved ({', '.join(parts)}): "
                        + ", ".join(names[:10]) + (" ..." if len(names) > 10 else ""),
                evidence={"path": path, **{k: v[:200] for k, v in diff.items()}},
                fix="the file changed after it was written (a partial write, another job, a wrong copy); "
                    "restore from a checkpoint whose round trip checks out",
            ))
        with self._lock:
            own_files = {p for p in self.saved}
        if mine is None and other is not None and own_files:
            self.ctx.report(Finding(
                severity=Severity.ERROR, detector=self.name, ranks=[rank], step=self.step or None,
                subject=Path(path).name,
                message=f"rank {rank} restored {Path(path).name}, which rank {other[0]} saved, although it saved "
                        f"its own checkpoint ({', '.join(Path(p).name for p in sorted(own_files))[:200]}): "
                        "a sharded checkpoint restored from the wrong shard",
                evidence={"path": path, "saved_by": other[0], "own_files": sorted(own_files)[:20]},
                fix="load the file this rank saved (index paths by rank), or load through the sharding-aware API "
                    "(torch.distributed.checkpoint, engine.load_checkpoint)",
            ))
