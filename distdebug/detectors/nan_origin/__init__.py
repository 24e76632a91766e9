"""NanOrigin: where the first NaN/Inf came from: the step, the rank it started on, the first parameter
(backward order) whose gradient was non-finite and the first module (forward order) whose output was.

Why it needs more than the loss: an all-reduce spreads one rank's NaN gradient to every rank in the
same step, so after the step every rank looks guilty. What tells them apart is each rank's *local*
gradient before the reduction:

- DDP: with its default ``gradient_as_bucket_view=False`` the reducer reduces copies of the
  gradients in its buckets and copies the results back into ``.grad`` when it finalises, at the end
  of the backward; a callback queued when the backward starts (``ctx.end_of_backward``) runs before
  that and reads every local gradient at once (one fused reduction on a device, no host sync).
  With ``gradient_as_bucket_view=True`` the gradients are the buckets, reduced in place as each is
  ready: there a hook on each parameter (``register_post_accumulate_grad_hook``) sees its local
  gradient once autograd has accumulated it, before the reducer does. DDP's reduction is never
  touched (its own path, or the script's communication hook whenever registered): bitwise the same
  by construction. Both go in before the model's first backward, so a NaN in step 1 has its origin too.
- Hand-written all_reduce: the input of each ``all_reduce`` is checked before the call (named by
  the parameter whose ``.grad`` it is, or as a flattened buffer).
- Modules: forward hooks on leaf modules and modules with parameters record whether each output
  was finite (one reduction per module, no host sync). Modules whose output is finite whenever
  their input and parameters are (activations, pooling, dropout; embeddings and normalisations
  where the parameters are checked whole) get none: the model's input is checked instead.
  On-demand watch (``config.watch``, the default where one rank can re-execute its forward alone):
  these hooks are on only while the step found non-finite is re-executed from a forward-only
  capture (runtime.rerun: the step's inputs, generator and autocast states, one copy of the
  parameters and buffers), so a healthy step pays for the capture, not for a reduction and a hooked
  call per module; full watch keeps them on in every step (FSDP2, DeepSpeed, TP, pipelines,
  SyncBatchNorm, a forward that communicates, a compiled model, several models; or when asked).
  The DDP local gradients' norms are shared with loss_spike (runtime.localgrads).

All flags are device tensors; at the step boundary one fused check over them and over the
parameters after the step (a non-finite gradient reaches its parameter through the update) is one
device scalar, read with the harness's
other values in the step's single host read (runtime.readout). Only when it fails are the flags
read one by one (the rare path). The module hooks come in at the end of step 1 (discovery), so a
NaN in step 1 is found by its step and local gradients (DDP), not by its module.

FSDP2 and DeepSpeed reduce gradients inside the framework: there the finding names the step and
the module, and says that the origin rank could not be told.

AMP: a step that a loss scaler (``torch.amp.GradScaler``, DeepSpeed fp16) skipped because its scaled
gradients overflowed is not a finding when the forward's outputs and the loss were finite (that
is the scaler doing its job; ``loss_scale`` records it). A non-finite forward output or loss is
found as ever, with its origin rank, skipped step or not.

``--stop-on-nan``: after the finding is written, the rank ends with EXIT_NAN (every rank sees the
NaN in the same step once it has been reduced).

Where each mechanism lives (``NanOrigin`` below composes them behind the registry's one entry):
``watch.py`` the per-step watch and ``attach``; ``replay.py`` on-demand localisation by re-execution;
``gradients.py`` the local gradients (DDP, hand-written all_reduce); ``collectives.py`` TP collectives and
FSDP2 shards; ``state.py`` never-finite parameters and buffers; ``verdict.py`` the judgement and the
finding's wording; ``flags.py`` the device flags they all record; ``core.py`` the fields they share.
"""

from __future__ import annotations

from collections.abc import Iterable

from distdebug.cards.nan_origin import CARD
from distdebug.config import NanOriginConfig
from distdebug.detectors.base import Detector
from distdebug.detectors.nan_origin.collectives import fsdp_params
from distdebug.detectors.nan_origin.core import NanOriginState, StateCheck
from distdebug.detectors.nan_origin.flags import (
    FINITE_GIVEN_PARAMETERS_NAMES,
    FINITE_PRESERVING_NAMES,
    INF,
    MAX_KEYS,
    finite_flag,
    finite_norm,
    finite_preserving,
    fold_in,
    max_abs_each,
)
from distdebug.detectors.nan_origin.state import FIRST_CHECK, MAX_STATE_CHECKS
from distdebug.detectors.nan_origin.verdict import Verdict
from distdebug.detectors.nan_origin.watch import Watch
from distdebug.findings import Finding, Severity

__all__ = [
    "FINITE_GIVEN_PARAMETERS_NAMES", "FINITE_PRESERVING_NAMES", "FIRST_CHECK", "INF", "MAX_KEYS",
    "MAX_STATE_CHECKS", "NanOrigin", "NanOriginState", "StateCheck", "finite_flag", "finite_norm",
    "finite_preserving", "fold_in", "fsdp_params", "max_abs_each",
]


class NanOrigin(Watch, Verdict):
    """The registry's ``nan_origin``: the mechanisms' classes composed (each defines its own hooks and
    methods, none overrides another's); here only what ties them together: the handover to the next
    training phase and the end (unhooking what gradients.py and collectives.py installed, the summary)."""

    name = "nan_origin"
    needs_model = True
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    Config = NanOriginConfig

    def handover(self, successor: Detector) -> None:
        """A new training phase: models already checked are not checked again as if never run (a fresh model,
        a next fold's, is); what was noted before it (a to_empty, a load's pending check) goes on."""
        if isinstance(successor, NanOrigin):
            successor._first_forward_seen |= self._first_forward_seen
            successor._state = self._state + successor._state
            successor._to_empty_at = successor._to_empty_at or self._to_empty_at

    def on_end(self) -> Iterable[Finding]:
        if self.ctx is not None and self._observe in self.ctx.communication_observers:
            self.ctx.communication_observers.remove(self._observe)
        for shared, listener in self._readers:  # not told of later backwards once over
            if listener in shared.listeners:
                shared.listeners.remove(listener)
        self._readers = []
        if self.count > 1 and self.ctx is not None:
            return (Finding(
                severity=Severity.INFO, detector=self.name, ranks=[self.ctx.rank], step=self.first_step,
                subject="non-finite steps", message=f"values stayed non-finite in {self.count} steps from step "
                                                     f"{self.first_step} on", evidence={"nonfinite_steps": self.count},
            ),)
        return ()
