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

Where each mechanism lives (``CheckpointRoundTrip`` below composes them behind the registry's one entry):
``saves.py`` the saves and their records; ``loads.py`` the loads and their comparison; ``pretrained.py``
Hugging Face's ``from_pretrained``; ``shards.py`` the wrong-shard judgement; ``records.py`` the record's
reading and the pure comparisons; ``core.py`` the fields they share.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from distdebug.cards.checkpoint_roundtrip import CARD
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.checkpoint_roundtrip.core import RoundTripState
from distdebug.detectors.checkpoint_roundtrip.pretrained import Pretrained
from distdebug.detectors.checkpoint_roundtrip.records import (
    BUFFER_SAVES,
    EARLIER_RUNS,
    RECORDS,
    RESTORE_FIX,
    closest,
    compare_saved,
    file_stamp,
    paths_saved_by,
    read_buffer_saves,
    saves_in,
    siblings,
    target,
    tensor_items,
)
from distdebug.detectors.checkpoint_roundtrip.saves import Saves
from distdebug.detectors.checkpoint_roundtrip.shards import WrongShards
from distdebug.findings import Finding
from distdebug.runtime.imports import ImportHook, when_imported

__all__ = [
    "BUFFER_SAVES", "DCP_MODULE", "EARLIER_RUNS", "RECORDS", "RESTORE_FIX", "SAFETENSORS_MODULE",
    "TRANSFORMERS_MODULE", "CheckpointRoundTrip", "RoundTripState", "closest", "compare_saved", "file_stamp",
    "paths_saved_by", "read_buffer_saves", "saves_in", "siblings", "target", "tensor_items",
]

DCP_MODULE = "torch.distributed.checkpoint"
SAFETENSORS_MODULE = "safetensors.torch"
TRANSFORMERS_MODULE = "transformers.modeling_utils"

_ImportHook = ImportHook  # the name the tests know it by


class CheckpointRoundTrip(Pretrained, Saves, WrongShards):
    """The registry's ``checkpoint_roundtrip``: the mechanisms' classes composed (none overrides another's);
    here only the wiring (what is patched, at once or when the script imports it) and the step and end."""

    name = "checkpoint_roundtrip"
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds
    paused = False  # --measure-overhead: a save and its load must both be seen (they are rare, not per step)

    def setup(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self._patch(torch, "save", self._wrap_save)
        self._patch(torch, "load", self._wrap_load)
        for module, then in ((DCP_MODULE, self._patch_dcp), (SAFETENSORS_MODULE, self._patch_safetensors),
                             (TRANSFORMERS_MODULE, self._patch_pretrained)):
            hook = when_imported(module, then)
            if hook is not None:
                self._hooks.append(hook)

    def _patch_dcp(self, dcp: Any) -> None:
        self._patch(dcp, "save", self._wrap_dcp_save)
        self._patch(dcp, "load", self._wrap_dcp_load)

    def _patch_safetensors(self, st: Any) -> None:
        self._patch(st, "save_file", self._wrap_save)
        self._patch(st, "load_file", self._wrap_load)

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
