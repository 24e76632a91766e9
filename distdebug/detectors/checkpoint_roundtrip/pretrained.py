"""Hugging Face ``PreTrainedModel.from_pretrained(directory)``: it reads through safetensors' lazy
``safe_open`` (a native object, not wrapped), so the model it returns is compared with what was saved in
that directory's ``*.safetensors``.

Why a mechanism of its own: a classmethod patched and restored by hand (outside ``Detector.patch``), and a
comparison of a model's state dict with the saves of several files, unlike a load's one object."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from distdebug.detectors.checkpoint_roundtrip.loads import Loads
from distdebug.detectors.checkpoint_roundtrip.records import RESTORE_FIX
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.pending import fingerprints


class Pretrained(Loads):
    """The patch of ``from_pretrained`` and the check of the model it returns."""

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
                det.check_safely(det._check_pretrained, model, where)
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
