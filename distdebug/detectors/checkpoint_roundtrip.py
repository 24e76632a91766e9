"""CheckpointRoundTrip: what a restore reads must be what the save wrote.

Covered, without code changes:
- ``torch.save`` / ``torch.load`` of a path (state dicts, optimizer state, nested dicts and lists);
- DeepSpeed ``engine.save_checkpoint`` / ``load_checkpoint``: DeepSpeed writes and reads every file
  through ``torch.save`` / ``torch.load``, so each of its files is checked like the above;
- ``torch.distributed.checkpoint`` (DCP) ``save`` / ``load``: each rank's part of the state dict
  (the local shards of DTensors) is compared with what the same rank saved. DCP is wrapped when the
  script imports it (an import hook), so runs without DCP never pay for importing it.

At save, every tensor is fingerprinted under its key path and recorded in this rank's
``rank-N/checkpoints.jsonl`` with the file's size and modification time. At load of a path saved
earlier, in this run or in an earlier run under the same runs root (the restart after a crash),
the restored tensors are fingerprinted and compared: a tensor that differs, is missing or is extra
is a finding naming it. A restore from an earlier run of a file that was rewritten since (its
modification time changed) is a warning rather than an error: someone else may have saved there.
A rank that restores the file another rank saved, while it saved a sibling file of its own (same
name but for the rank digits: ``ckpt_0.pt`` / ``ckpt_1.pt``) is restoring the wrong shard; loading
rank 0's file everywhere, as replicated training does, is fine.

- file objects: a file opened on a path (``open()``, fsspec's local files: their ``name`` / ``path``)
  counts as that path. A save into a buffer (``io.BytesIO``: Lightning serialises its checkpoint
  there and writes the bytes through fsspec) has no path; it is recorded by content, and a load that
  no save of its path explains is compared with the buffer saves of every rank that hold the same
  tensor names: an exact match passes; the closest one differing in a few tensors (at most a tenth,
  at least one) is a finding naming them; one differing in more is another checkpoint, not judged;
- safetensors ``save_file`` / ``load_file`` (what Hugging Face ``save_pretrained`` and the Trainer's
  resume from ``model.safetensors`` use), wrapped when the script imports ``safetensors.torch``.

DCP ``Stateful`` objects inside a state dict are not looked into (their ``state_dict()`` may run
collectives, which the harness must never add), nor is ``async_save``; nor safetensors' lazy
``safe_open`` itself: Hugging Face ``from_pretrained(directory)`` reads through it, so the model it
returns is compared with what was saved in that directory's ``*.safetensors``; nor other file formats.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from distdebug.artifacts import layout
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.hashing import fingerprints
from distdebug.runtime.imports import ImportHook, when_imported

RECORDS = layout.CHECKPOINTS
EARLIER_RUNS = 50
"""Newest sibling run directories searched for a checkpoint saved by an earlier run."""
DCP_MODULE = "torch.distributed.checkpoint"
SAFETENSORS_MODULE = "safetensors.torch"
TRANSFORMERS_MODULE = "transformers.modeling_utils"
BUFFER_SAVES = 16
RESTORE_FIX = ("the file changed after it was written (a partial write, another job, a wrong copy); "
               "restore from a checkpoint whose round trip checks out")
"""Buffer saves this rank keeps in memory for a later load to be compared with (their records stay)."""


def target(f: Any) -> str | None:
    """The path a save or load goes to: a path, or a file object opened on one; None for a buffer."""
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)  # type: ignore[return-value]
    for attr in ("path", "name"):  # fsspec's local files; open()'s
        value = getattr(f, attr, None)
        if isinstance(value, str) and value:
            return value
    return None


def closest(saves: list[dict[str, Any]], loaded: dict[str, int]) -> tuple[dict[str, Any], list[str]] | None:
    """The save with the same tensor names that ``loaded`` differs least from, with the names that differ;
    None when no save has those names, or when the closest differs in too many to be its corruption."""
    best: tuple[dict[str, Any], list[str]] | None = None
    for save in saves:
        fps = save["fps"]
        if fps.keys() != loaded.keys():
            continue
        differ = [k for k in fps if fps[k] != loaded[k]]
        if best is None or len(differ) < len(best[1]):
            best = (save, differ)
    if best is None or len(best[1]) > max(1, len(loaded) // 10):
        return None
    return best


def siblings(a: str, b: str) -> bool:
    """Same file name but for the digits (``ckpt_0.pt`` and ``ckpt_1.pt``), in the same directory."""
    pa, pb = Path(a), Path(b)
    return pa.parent == pb.parent and pa.name != pb.name and \
        re.sub(r"\d+", "#", pa.name) == re.sub(r"\d+", "#", pb.name)


def _file_stamp(path: str) -> dict[str, int] | None:
    """Size and modification time of a file, or of a directory's files (DCP), to tell a rewrite."""
    p = Path(path)
    try:
        files = [p] if p.is_file() else sorted(x for x in p.iterdir() if x.is_file())
        stats = [f.stat() for f in files]
    except OSError:
        return None
    return {"size": sum(st.st_size for st in stats), "mtime_ns": max((st.st_mtime_ns for st in stats), default=0)}


_ImportHook = ImportHook  # the name the tests know it by


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
    paused = False  # --measure-overhead: a save and its load must both be seen (they are rare, not per step)

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

    def setup(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self._patch(torch, "save", self._wrap_save)
        self._patch(torch, "load", self._wrap_load)
        for module, then in ((DCP_MODULE, self._patch_dcp), (SAFETENSORS_MODULE, self._patch_safetensors),
                             (TRANSFORMERS_MODULE, self._patch_pretrained)):
            hook = when_imported(module, then)
            if hook is not None:
                self._hooks.append(hook)

    def _patch(self, obj: Any, name: str, wrapper: Any) -> None:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        self.patch(ctx, obj, name, wrapper)

    def _patch_dcp(self, dcp: Any) -> None:
        self._patch(dcp, "save", self._wrap_dcp_save)
        self._patch(dcp, "load", self._wrap_dcp_load)

    def _patch_safetensors(self, st: Any) -> None:
        self._patch(st, "save_file", self._wrap_save)
        self._patch(st, "load_file", self._wrap_load)

    def _patch_pretrained(self, modeling: Any) -> None:
        """``PreTrainedModel.from_pretrained(directory)`` reads through safetensors' lazy ``safe_open`` (a
        native object, not wrapped): the model it returns is compared with what was saved in that
        directory instead. A classmethod: patched and restored as one, so subclasses still bind to theirs."""
        cls: Any = getattr(modeling, "PreTrainedModel", None)
        descriptor = getattr(cls, "__dict__", {}).get("from_pretrained")
        func = getattr(descriptor, "__func__", None)
        if cls is None or func is None:
            return
        det = self

        @functools.wraps(func)
        def from_pretrained(klass: Any, *args: Any, **kwargs: Any) -> Any:
            model = func(klass, *args, **kwargs)
            if not det.off:
                where = args[0] if args else kwargs.get("pretrained_model_name_or_path")
                det._guard(det._check_pretrained, model, where)
            return model

        cls.from_pretrained = classmethod(from_pretrained)
        self._restore.append((cls, "from_pretrained", descriptor))

    def _check_pretrained(self, model: Any, where: Any) -> None:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        if not isinstance(where, (str, os.PathLike)) or not os.path.isdir(where):
            return  # a hub id (nothing saved here to compare with)
        saved: dict[str, tuple[int, str, int, Any]] = {}  # tensor -> (fingerprint, file, saver, step)
        for file in sorted(Path(where).resolve().glob("*.safetensors")):
            found = self._find_save(str(file))
            if found is not None:
                _, saver, rec = found
                saved.update({k: (v, file.name, saver, rec.get("step")) for k, v in rec["fps"].items()})
        state = getattr(model, "state_dict", None)
        if not saved or state is None:
            return
        loaded = fingerprints([(k, v) for k, v in state().items() if k in saved], portable=True)
        differ = [k for k in loaded if loaded[k] != saved[k][0]]
        if not differ or len(differ) > max(1, len(loaded) // 10):
            return  # equal; or loaded otherwise (another dtype, a conversion): not judged
        _, fname, saver, step = saved[differ[0]]
        ctx.report(Finding(
            severity=Severity.ERROR, detector=self.name, ranks=[ctx.rank], step=self.step or None, subject=differ[0],
            message=f"from_pretrained({Path(where).name}) loaded {len(differ)} of {len(loaded)} tensors unlike what "
                    f"rank {saver} saved in {fname} at step {step}: " + ", ".join(differ[:10])
                    + (" ..." if len(differ) > 10 else ""),
            evidence={"path": str(Path(where).resolve()), "file": fname, "saved_by": saver, "saved_at_step": step,
                      "differ": differ[:200]},
            fix=RESTORE_FIX,
        ))

    def on_end(self) -> Iterable[Finding]:
        for hook in self._hooks:
            hook.remove()
        for obj, name, original in reversed(self._restore):
            setattr(obj, name, original)
        self._restore = []
        return self._wrong_shards()

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        self.step = event.step
        return self._wrong_shards() if self._foreign else ()

    # ------------------------------------------------------------------ save / load
    def _wrap_save(self, original: Any) -> Any:
        det = self

        @functools.wraps(original)
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(obj, f, *args, **kwargs)
            path = target(f)
            if path is not None:
                det._guard(det._record_save, obj, path)
            elif hasattr(f, "write"):
                det._guard(det._record_buffer_save, obj, "a buffer")
            return result

        return save

    def _wrap_load(self, original: Any) -> Any:
        det = self

        @functools.wraps(original)
        def load(f: Any, *args: Any, **kwargs: Any) -> Any:
            obj = original(f, *args, **kwargs)
            det._guard(det._check_load, obj, target(f) or "a buffer")
            return obj

        return load

    def _wrap_dcp_save(self, original: Any) -> Any:
        det = self

        @functools.wraps(original)
        def save(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(state_dict, *args, **kwargs)
            path = kwargs.get("checkpoint_id") or getattr(kwargs.get("storage_writer"), "path", None)
            if isinstance(path, (str, os.PathLike)):
                det._guard(det._record_save, state_dict, path)
            return result

        return save

    def _wrap_dcp_load(self, original: Any) -> Any:
        det = self

        @functools.wraps(original)
        def load(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(state_dict, *args, **kwargs)  # DCP restores in place
            path = kwargs.get("checkpoint_id") or getattr(kwargs.get("storage_reader"), "path", None)
            if isinstance(path, (str, os.PathLike)):
                det._guard(det._check_load, state_dict, path)
            return result

        return load

    def _guard(self, fn: Any, obj: Any, f: Any) -> None:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        try:
            fn(obj, f)
        except Exception as e:  # never break the user's save or load
            ctx.report(Finding(
                severity=Severity.INFO, detector="harness", ranks=[ctx.rank], step=self.step or None,
                subject=f"detector:{self.name}", message=f"could not check {f}: {type(e).__name__}: {e}",
            ))

    def _records_path(self, rank: int) -> Path | None:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        return layout.rank_dir(ctx.run_dir, rank) / RECORDS if ctx.run_dir is not None else None

    def _record_save(self, obj: Any, f: Any) -> None:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        path = str(Path(f).resolve())
        fps = fingerprints(tensor_items(obj), portable=True)  # a GPU save may be loaded onto the CPU
        with self._lock:
            self.saved[path] = {"fps": fps, "step": self.step}
        records = self._records_path(ctx.rank)
        if records is not None:
            records.parent.mkdir(parents=True, exist_ok=True)
            with open(records, "a") as out:
                out.write(json.dumps({"v": 1, "op": "save", "path": path, "step": self.step,
                                      "rank": ctx.rank, "stamp": _file_stamp(path),
                                      "fps": {k: f"{v:016x}" for k, v in fps.items()}}) + "\n")

    @staticmethod
    def _paths_saved_by(run_dir: Path, rank: int) -> set[str]:
        records = layout.rank_dir(run_dir, rank) / RECORDS
        out = set()
        try:
            for line in records.read_text().splitlines():
                try:
                    out.add(json.loads(line)["path"])
                except (ValueError, KeyError):
                    continue
        except OSError:
            pass
        return out

    @staticmethod
    def _saves_in(run_dir: Path, path: str) -> list[tuple[int, dict[str, Any]]]:
        """(rank, last save record of ``path``) for every rank of one run directory that saved it."""
        out = []
        for rank_dir in sorted(run_dir.glob("rank-*")):
            rank = layout.rank_of_dir(rank_dir.name)
            records = rank_dir / RECORDS
            if rank is None or not records.exists():
                continue
            found = None
            for line in records.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if rec.get("path") == path:
                    found = rec
            if found is not None:
                out.append((rank, found))
        return out

    def _earlier_runs(self) -> list[Path]:
        """Sibling run directories (the same runs root), newest first."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        if ctx.run_dir is None:
            return []
        here = Path(ctx.run_dir).resolve()
        try:
            runs = [d for d in here.parent.iterdir()
                    if d.is_dir() and not d.is_symlink() and d.resolve() != here and (d / layout.MANIFEST).exists()]
        except OSError:
            return []
        return sorted(runs, key=lambda d: d.stat().st_mtime, reverse=True)[:EARLIER_RUNS]

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
            candidates.append(("this run", self._saves_in(Path(ctx.run_dir), path)))
        for run in self._earlier_runs():
            saves = self._saves_in(run, path)
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
            mine_there = {p for p in self._paths_saved_by(run_dir, rank) if siblings(p, path)}
            return where, r, {"fps": fps, "step": rec.get("step"), "stamp": rec.get("stamp"), "own": mine_there}
        return None

    def _record_buffer_save(self, obj: Any, f: Any) -> None:
        """A save into a buffer: kept by content (this rank's latest few in memory, every one recorded)."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        fps = fingerprints(tensor_items(obj), portable=True)
        if not fps:
            return
        with self._lock:
            self._buffers = [*self._buffers[-(BUFFER_SAVES - 1):], {"fps": fps, "step": self.step, "rank": ctx.rank}]
        records = self._records_path(ctx.rank)
        if records is not None:
            records.parent.mkdir(parents=True, exist_ok=True)
            with open(records, "a") as out:
                out.write(json.dumps({"v": 1, "op": "save", "path": None, "buffer": True, "step": self.step,
                                      "rank": ctx.rank, "fps": {k: f"{v:016x}" for k, v in fps.items()}}) + "\n")

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
            self._others = (self.step, self._read_buffer_saves(Path(ctx.run_dir), ctx.rank))
        return out + self._others[1]

    @staticmethod
    def _read_buffer_saves(run_dir: Path, me: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for rank_dir in sorted(run_dir.glob("rank-*")):
            rank = layout.rank_of_dir(rank_dir.name)
            if rank is None or rank == me or not (rank_dir / RECORDS).exists():
                continue
            for line in (rank_dir / RECORDS).read_text().splitlines()[-1000:]:
                try:
                    rec = json.loads(line)
                    if rec.get("buffer"):
                        out.append({"fps": {k: int(v, 16) for k, v in rec["fps"].items()}, "step": rec.get("step"),
                                    "rank": rank})
                except (ValueError, KeyError, AttributeError):
                    continue  # a line cut short by a kill
        return out

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
        rewritten = earlier and rec.get("stamp") is not None and rec["stamp"] != _file_stamp(path)
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

    def _wrong_shards(self) -> list[Finding]:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        with self._lock:
            pending, self._foreign = self._foreign, []
            loaded = set(self._loaded)
        out = []
        for item in pending:
            if any(p in loaded for p in item["own"]):
                continue
            rank, name = ctx.rank, Path(item["path"]).name
            out.append(Finding(
                severity=Severity.ERROR, detector=self.name, ranks=[rank], step=item["step"], subject=name,
                message=f"rank {rank} restored {name}, which rank {item['saver']} saved, although it saved "
                        f"its own ({', '.join(Path(p).name for p in item['own'])[:200]}) and did not restore "
                        "that: a sharded checkpoint restored from the wrong shard",
                evidence={"path": item["path"], "saved_by": item["saver"], "own_files": item["own"][:20]},
                fix="load the file this rank saved (index paths by rank), or load through the sharding-aware API "
                    "(torch.distributed.checkpoint, engine.load_checkpoint)",
            ))
        return out
