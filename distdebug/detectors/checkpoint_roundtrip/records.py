"""The checkpoint records and the pure functions over them: where a save or load goes (a path, a file
object, a buffer), the tensors of a state dict under their key paths, how two sets of fingerprints differ,
and the reading of every rank's ``checkpoints.jsonl`` in this run directory or an earlier one.

Why a module of its own: saves.py writes these records, loads.py and pretrained.py read them back; the
record's reading and the comparisons are plain functions of files and dicts, testable without a run."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from distdebug import strictjson
from distdebug.artifacts import layout

RECORDS = layout.CHECKPOINTS
EARLIER_RUNS = 50
"""Newest sibling run directories searched for a checkpoint saved by an earlier run."""
BUFFER_SAVES = 16
"""Buffer saves this rank keeps in memory for a later load to be compared with (their records stay)."""
RESTORE_FIX = ("the file changed after it was written (a partial write, another job, a wrong copy); "
               "restore from a checkpoint whose round trip checks out")


def target(f: Any) -> str | None:
    """The path a save or load goes to: a path, or a file object opened on one; None for a buffer."""
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)  # type: ignore[return-value]
    for attr in ("path", "name"):  # fsspec's local files; open()'s
        value = getattr(f, attr, None)
        if isinstance(value, str) and value:
            return value
    return None


def dcp_path(kwargs: dict[str, Any], storage: str) -> str | os.PathLike | None:
    """The directory a torch.distributed.checkpoint save or load names: its ``checkpoint_id``, or its
    storage writer's or reader's (``storage``: ``storage_writer`` / ``storage_reader``) ``path``; None when
    neither is a path (a storage of another kind: nothing to compare)."""
    path = kwargs.get("checkpoint_id") or getattr(kwargs.get(storage), "path", None)
    return path if isinstance(path, (str, os.PathLike)) else None


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


def file_stamp(path: str) -> dict[str, int] | None:
    """Size and modification time of a file, or of a directory's files (DCP), to tell a rewrite."""
    p = Path(path)
    try:
        files = [p] if p.is_file() else sorted(x for x in p.iterdir() if x.is_file())
        stats = [f.stat() for f in files]
    except OSError:
        return None
    return {"size": sum(st.st_size for st in stats), "mtime_ns": max((st.st_mtime_ns for st in stats), default=0)}


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


def paths_saved_by(run_dir: Path, rank: int) -> set[str]:
    """Every path ``rank`` recorded a save of in ``run_dir`` (its own files: what a restart should restore)."""
    records = layout.checkpoints_path(run_dir, rank)
    out = set()
    try:
        for line in records.read_text().splitlines():
            try:
                out.add(strictjson.loads(line)["path"])
            except (ValueError, KeyError):
                continue
    except OSError:
        pass
    return out


def saves_in(run_dir: Path, path: str) -> list[tuple[int, dict[str, Any]]]:
    """(rank, last save record of ``path``) for every rank of one run directory that saved it."""
    out = []
    for rank, _ in layout.rank_dirs(run_dir):
        records = layout.checkpoints_path(run_dir, rank)
        if not records.exists():
            continue
        found = None
        for line in records.read_text().splitlines():
            try:
                rec = strictjson.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if rec.get("path") == path:
                found = rec
        if found is not None:
            out.append((rank, found))
    return out


def read_buffer_saves(run_dir: Path, me: int) -> list[dict[str, Any]]:
    """The buffer saves the other ranks of ``run_dir`` recorded (the last 1,000 records of each), by content."""
    out: list[dict[str, Any]] = []
    for rank, _ in layout.rank_dirs(run_dir):
        records = layout.checkpoints_path(run_dir, rank)
        if rank == me or not records.exists():
            continue
        for line in records.read_text().splitlines()[-1000:]:
            try:
                rec = strictjson.loads(line)
                if rec.get("buffer"):
                    out.append({"fps": {k: int(v, 16) for k, v in rec["fps"].items()}, "step": rec.get("step"),
                                "rank": rank})
            except (ValueError, KeyError, AttributeError):
                continue  # a line cut short by a kill
    return out
