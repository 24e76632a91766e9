"""Loads: ``torch.load``, safetensors ``load_file`` and DCP ``load``, the restored tensors fingerprinted
and compared with the save of the same path (this rank's, another rank's, or an earlier run's under the
same runs root), or, when no save of the path explains it, with the buffer saves of every rank by content.

Why a mechanism of its own: finding which save a load should equal (and whether the file was rewritten
since, or is another rank's sibling shard) is the detector's localisation; the finding names the tensors
that differ, are missing or are extra. A restore of another rank's shard is queued for shards.py."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from distdebug.artifacts import runs
from distdebug.detectors.checkpoint_roundtrip.core import RoundTripState
from distdebug.detectors.checkpoint_roundtrip.records import (
    EARLIER_RUNS,
    RESTORE_FIX,
    closest,
    compare_saved,
    dcp_path,
    file_stamp,
    paths_saved_by,
    read_buffer_saves,
    saves_in,
    siblings,
    target,
    tensor_items,
)
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.pending import fingerprints


class Loads(RoundTripState):
    """Wrappers of the load functions and the comparison of what they restored."""

    def _wrap_load(self, original: Any) -> Any:
        det = self

        @functools.wraps(original)
        def load(f: Any, *args: Any, **kwargs: Any) -> Any:
            obj = original(f, *args, **kwargs)
            det.check_safely(det._check_load, obj, target(f) or "a buffer")
            return obj

        return load

    def _wrap_dcp_load(self, original: Any) -> Any:
        det = self

        @functools.wraps(original)
        def load(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(state_dict, *args, **kwargs)  # DCP restores in place
            path = dcp_path(kwargs, "storage_reader")
            if path is not None:
                det.check_safely(det._check_load, state_dict, path)
            return result

        return load

    def _earlier_runs(self) -> list[Path]:
        """Sibling run directories (the same runs root), newest first."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        if ctx.run_dir is None:
            return []
        return runs.sibling_runs(Path(ctx.run_dir), EARLIER_RUNS)

    def _find_save(self, path: str) -> tuple[str, int, dict[str, Any]] | None:
        """Where ``path`` was saved, preferring this rank's own save: ("this run" or a run directory, rank, record)."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        rank = ctx.rank
        with self._lock:
            mine = self.saved.get(path)
        if mine is not None:
            return "this run", rank, {"fps": mine["fps"], "step": mine["step"]}
        candidates: list[tuple[str, list[tuple[int, dict[str, Any]]]]] = []
        if ctx.run_dir is not None:
            candidates.append(("this run", saves_in(Path(ctx.run_dir), path)))
        for run in self._earlier_runs():
            saves = saves_in(run, path)
            if saves:
                candidates.append((str(run), saves))
                break  # the newest earlier run that saved it
        for where, saves in candidates:
            if not saves:
                continue
            own = [s for s in saves if s[0] == rank]
            r, rec = (own or saves)[0]
            fps = {k: int(v, 16) for k, v in rec["fps"].items()}
            # This rank's own files from that save (a restart restores what the earlier run saved).
            run_dir = ctx.run_dir if where == "this run" and ctx.run_dir is not None else Path(where)
            mine_there = {p for p in paths_saved_by(run_dir, rank) if siblings(p, path)}
            return where, r, {"fps": fps, "step": rec.get("step"), "stamp": rec.get("stamp"), "own": mine_there}
        return None

    def _buffer_saves(self) -> list[dict[str, Any]]:
        """Every rank's buffer saves in this run (this rank's from memory, the others' from their records,
        read once a step at most: a script may torch.load many buffers in a step, its data among them)."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        with self._lock:
            out = list(self._buffers)
        if ctx.run_dir is None:
            return out
        if self._others[0] != self.step:
            self._others = (self.step, read_buffer_saves(Path(ctx.run_dir), ctx.rank))
        return out + self._others[1]

    def _check_by_content(self, obj: Any, path: str) -> None:
        """A load that no save of its path explains, compared with the buffer saves (module docstring)."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        saves = self._buffer_saves()
        if not saves:
            return
        loaded = fingerprints(tensor_items(obj), portable=True)
        if len(loaded) < 2:
            return  # one tensor: a different one and a corrupted one cannot be told apart
        found = closest(saves, loaded)
        if found is None or not found[1]:
            return
        save, differ = found
        name = Path(path).name if path != "a buffer" else path
        with self._lock:
            if (path, tuple(differ)) in self._reported:
                return
            self._reported.add((path, tuple(differ)))
        ctx.report(Finding(
            severity=Severity.ERROR, detector=self.name, ranks=[ctx.rank], step=self.step or None, subject=differ[0],
            message=f"restored {name} does not match what rank {save['rank']} saved at step {save['step']} "
                    f"({len(differ)} of {len(loaded)} tensors differ, the rest are equal): " + ", ".join(differ[:10])
                    + (" ..." if len(differ) > 10 else ""),
            evidence={"path": path, "saved_by": save["rank"], "saved_at_step": save["step"], "differ": differ[:200],
                      "matched_by": "content (the save went into a buffer: no path)"},
            fix=RESTORE_FIX,
        ))

    def _check_load(self, obj: Any, f: Any) -> None:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        if f == "a buffer":
            self._check_by_content(obj, f)
            return
        path = str(Path(f).resolve())
        found = self._find_save(path)
        if found is None:
            self._check_by_content(obj, path)  # saved into a buffer and written by other code, perhaps
            return
        where, saver, rec = found
        loaded = fingerprints(tensor_items(obj), portable=True)
        diff = compare_saved(rec["fps"], loaded)
        rank = ctx.rank
        earlier = where != "this run"
        rewritten = earlier and rec.get("stamp") is not None and rec["stamp"] != file_stamp(path)
        names = diff["differ"] + diff["missing"] + diff["extra"]
        with self._lock:
            repeated = (path, tuple(names)) in self._reported  # DeepSpeed reads its model file twice
            self._reported.add((path, tuple(names)))
        if names and not repeated:
            parts = [f"{len(v)} {k}" for k, v in diff.items() if v]
            origin = f"rank {saver} saved at step {rec.get('step')}" \
                + (f" of run {Path(where).name}" if earlier else "")
            note = "; the file was rewritten after that save (another job or run may have saved there)" \
                if rewritten else ""
            ctx.report(Finding(
                severity=Severity.WARNING if rewritten else Severity.ERROR, detector=self.name, ranks=[rank],
                step=self.step or None, subject=names[0],
                message=f"restored {Path(path).name} does not match what {origin} ({', '.join(parts)}): "
                        + ", ".join(names[:10]) + (" ..." if len(names) > 10 else "") + note,
                evidence={"path": path, "saved_by": saver, "saved_in": where, "saved_at_step": rec.get("step"),
                          "rewritten_since": rewritten, **{k: v[:200] for k, v in diff.items()}},
                fix=RESTORE_FIX,
            ))
        with self._lock:
            self._loaded.add(path)
            own_files = sorted({p for p in self.saved if siblings(p, path)} | rec.get("own", set()))
            if saver != rank and own_files:
                # Judged at the next step boundary: DeepSpeed's elastic ZeRO load reads every rank's
                # file, its own included, which is right; only a rank that never reads its own is wrong.
                self._foreign.append({"path": path, "saver": saver, "step": self.step or None, "own": own_files})
