"""Saves: ``torch.save`` (and DeepSpeed's files, written through it), safetensors ``save_file`` and DCP
``save``, each tensor fingerprinted under its key path and recorded in this rank's ``checkpoints.jsonl``
with the file's stamp; a save into a buffer (no path) is recorded, and kept in memory, by content.

Why a mechanism of its own: the record written here is all a later load (loads.py), a restart's load in a
later run, or ``from_pretrained`` (pretrained.py) is compared with."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from distdebug.detectors.checkpoint_roundtrip.core import RoundTripState
from distdebug.detectors.checkpoint_roundtrip.records import BUFFER_SAVES, dcp_path, file_stamp, target, tensor_items
from distdebug.fingerprint.pending import fingerprints


class Saves(RoundTripState):
    """Wrappers of the save functions and the records they write."""

    def _wrap_save(self, original: Any) -> Any:
        det = self

        @functools.wraps(original)
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(obj, f, *args, **kwargs)
            path = target(f)
            if path is not None:
                det.check_safely(det._record_save, obj, path)
            elif hasattr(f, "write"):
                det.check_safely(det._record_buffer_save, obj, "a buffer")
            return result

        return save

    def _wrap_dcp_save(self, original: Any) -> Any:
        det = self

        @functools.wraps(original)
        def save(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(state_dict, *args, **kwargs)
            path = dcp_path(kwargs, "storage_writer")
            if path is not None:
                det.check_safely(det._record_save, state_dict, path)
            return result

        return save

    def _record_save(self, obj: Any, f: Any) -> None:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        path = str(Path(f).resolve())
        fps = fingerprints(tensor_items(obj), portable=True)  # a GPU save may be loaded onto the CPU
        with self._lock:
            self.saved[path] = {"fps": fps, "step": self.step}
        self.append_record({"v": 1, "op": "save", "path": path, "step": self.step, "rank": ctx.rank,
                            "stamp": file_stamp(path), "fps": {k: f"{v:016x}" for k, v in fps.items()}})

    def _record_buffer_save(self, obj: Any, f: Any) -> None:
        """A save into a buffer: kept by content (this rank's latest few in memory, every one recorded)."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        fps = fingerprints(tensor_items(obj), portable=True)
        if not fps:
            return
        with self._lock:
            self._buffers = [*self._buffers[-(BUFFER_SAVES - 1):], {"fps": fps, "step": self.step, "rank": ctx.rank}]
        self.append_record({"v": 1, "op": "save", "path": None, "buffer": True, "step": self.step, "rank": ctx.rank,
                            "fps": {k: f"{v:016x}" for k, v in fps.items()}})
