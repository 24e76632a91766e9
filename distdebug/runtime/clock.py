"""The step clock: what one training step is made of, counted between two step boundaries.

The session decides where a step ends (runtime.session); the clock keeps what happens in between and
turns it into the step's event and record: the loss summed over the step's backward calls (undoing a
GradScaler's scale and a framework's division by the accumulation steps), the backward calls, the
collectives, the step's time, and the step's one device-to-host read (runtime.readout) of the loss, the
loss scale and every detector's probe. Kept apart so that its arithmetic is tested without processes.
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from distdebug.artifacts import schema
from distdebug.context import RankContext, StepEvent
from distdebug.runtime import cost, discovery, frameworks
from distdebug.runtime.detector import Detector
from distdebug.runtime.progress import Progress
from distdebug.runtime.readout import Readout

NOT_TRAINING_STEPS = (("_init_optim_state", f"checkpoint{os.sep}state_dict.py"),)
"""Functions of torch that call ``optimizer.step()`` themselves, not to train: torch.distributed.checkpoint's
state-dict helpers (``get_optimizer_state_dict``, ``set_state_dict``...) step once with lr 0 and zero
gradients to create the optimizer's state before loading into it. Such a step is not counted."""


def not_a_training_step() -> bool:
    """Whether this optimizer step was called by one of NOT_TRAINING_STEPS (looked up only for a step
    with no backward call since the last boundary: a training step never pays for the walk). Called
    straight from the optimizer's step post-hook: the walk starts two frames up."""
    f: Any = sys._getframe(2)
    for _ in range(16):
        if f is None:
            return False
        code = f.f_code
        if any(code.co_name == name and code.co_filename.endswith(tail) for name, tail in NOT_TRAINING_STEPS):
            return True
        f = f.f_back
    return False


class StepClock:
    """One per session: the step in progress (reset at each boundary) and the run's running counts."""

    def __init__(self) -> None:
        # The step's losses, summed where they live (float64, one small tensor whatever the number of
        # backward calls: memory stays flat in loops that never step); read once at the boundary.
        self.loss_sum: torch.Tensor | float | None = None
        self.loss_n = 0
        # The same sum as backward ran on it (a framework's division kept): the loss whose gradient is the step's
        # accumulated gradient, which two layouts of one training share (distdebug parity reads it, not a read
        # of its own: it travels in the step's one read with the parity recorder's values).
        self.raw_sum: torch.Tensor | float | None = None
        self.keep_raw = False  # set by the parity recorder: without it the raw sum costs nothing (not kept)
        self.optimizer_steps = 0  # optimizer.step() calls seen (any optimizer): tells a step a scaler skipped
        # GradScaler.scale() outputs of this step (weak; a few): backward on one of them records the loss
        # divided by the scale. The scaler last used: its scale is read with the step's values.
        self.scaled: list[tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = []
        self.scaler_ref: weakref.ref[Any] | None = None
        self.backward_calls = 0
        self.reduced_at = False  # this step's backward_t is the arrival at a reducing backward
        self.backward_total = 0
        self.seq_at_boundary = 0  # collective_seq at the last step boundary
        self.t_last: float | None = None

    def start(self) -> None:
        """The first sign of training (a forward, a backward): the first step's time counts from here."""
        if self.t_last is None:
            self.t_last = time.perf_counter()

    def unmarked(self, steps: int) -> tuple[str, str] | None:
        """At the rank's end: (message, fix) when backward ran but no step boundary was ever seen (the
        loop steps no torch.optim optimizer); None otherwise."""
        if steps or not self.backward_total:
            return None
        return (f"{self.backward_total} backward calls but no step boundary: the loop does not call a torch.optim "
                "optimizer's step()", "call distdebug.step(loss) once per training step (and distdebug.watch(model))")

    def count_backward(self) -> None:
        self.backward_calls += 1
        self.backward_total += 1

    def arrive(self, ctx: RankContext, roots: Callable[[], list[torch.nn.Module]]) -> bool:
        """``ctx.backward_t``: the arrival at the gradient reduction (straggler). The step's first backward,
        or under accumulation (DDP's no_sync(), accelerate's and Lightning's) the first one that reduces: the
        micro-batches before it wait for no one, and a slow rank is late there by all of them. Returns whether
        this backward reduces (not every DDP wrapper is inside ``no_sync()``)."""
        reduces = not discovery.accumulating([d for d in map(discovery.find_ddp, roots()) if d])
        if self.backward_calls == 1 or not self.reduced_at:
            ctx.backward_t = time.monotonic()
            self.reduced_at = reduces
        return reduces

    def add_loss(self, t: Any, caller: Any, divided_by: float = 1.0) -> None:
        """Add what one backward ran on to the step's loss (a one-element tensor; anything else is not a
        loss). ``caller``: the frame that called the backward patch (a framework's division is read there).
        ``divided_by``: the division the backward applies itself before computing the gradient (DeepSpeed's
        engine divides the loss it is given by its accumulation steps): the raw sum is of the divided loss,
        as under a framework that divides before backward, so that one rank accumulating micro-batches and N
        ranks sum to the same loss."""
        if isinstance(t, torch.Tensor) and t.numel() == 1:
            v = raw = t.detach().to(torch.float64)
            if frameworks.loaded():  # accelerate's or Lightning's division by the accumulation steps, undone
                factor = frameworks.loss_factor(caller.f_back)
                if factor != 1.0:
                    v = v * factor
            scaler = next((sc() for out, sc in self.scaled if out() is t), None)
            scale = getattr(scaler, "_scale", None)
            if isinstance(scale, torch.Tensor):
                same = raw is v  # no framework factor: one division serves both
                v = v / scale.detach().to(torch.float64)  # on the device: the loss the script computed
                raw = v if same or not self.keep_raw else raw / scale.detach().to(torch.float64)
            if self.keep_raw:
                if divided_by != 1.0:
                    raw = raw / divided_by
                self.raw_sum = raw if self.raw_sum is None else self.raw_sum + raw
            self.loss_sum = v if self.loss_sum is None else self.loss_sum + v
            self.loss_n += 1

    def explicit(self, loss: Any) -> None:
        """``distdebug.step(loss)``: the step's loss is the one given."""
        self.loss_sum = loss.detach().to(torch.float64) if isinstance(loss, torch.Tensor) else float(loss)
        if self.keep_raw and self.raw_sum is None:  # backward ran on none: the loss given is all there is
            self.raw_sum = self.loss_sum
        self.loss_n = 1

    def note_scaled(self, scaler: Any, out: Any) -> None:
        """``GradScaler.scale(loss)`` returned ``out`` (loss times the scale): remembered weakly, a few."""
        if isinstance(out, torch.Tensor) and getattr(scaler, "_enabled", False):
            self.scaled = [*self.scaled[-7:], (weakref.ref(out), weakref.ref(scaler))]
            self.scaler_ref = weakref.ref(scaler)

    def read(self, detectors: list[Detector], ledger: cost.Ledger, step: int, off: bool,
             failed: Callable[[BaseException], None]) -> tuple[float | None, dict[str, dict[str, Any]], float | None]:
        """The step's one device-to-host read: the loss, the loss scale and every detector's probe
        (runtime.readout). ``off``: the detectors are paused (--measure-overhead): no loss is read.
        ``failed``: told when the read itself failed (every value of the step is then lost)."""
        readout = Readout()
        loss_sum, n = (None, 0) if off else (self.loss_sum, self.loss_n)
        if isinstance(loss_sum, torch.Tensor) and n:
            try:
                readout.add(("", "loss"), loss_sum)
            except Exception:  # a loss that cannot be read (complex?): the step goes on without it
                loss_sum = None
        scaler = self.scaler_ref() if self.scaler_ref is not None and not off else None
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            try:
                readout.add(("", "scale"), scale.reshape(()))
            except Exception:
                pass
        for det in list(detectors):
            if det.off or det.paused or type(det).probe is Detector.probe:
                continue
            try:
                for key, value in (cost.timed(ledger, det.name, det.probe, step) or {}).items():
                    if type(value) is list:
                        readout.add_many((det.name, key), value)
                    else:
                        readout.add((det.name, key), value)
            except Exception as e:
                det.fail(e, "probe")
        values: dict[Any, Any] = {}
        if len(readout):
            try:
                ledger.reads += 1
                values = readout.read()
            except Exception as e:  # ours; every detector's values are lost this step, training goes on
                failed(e)
        per_detector: dict[str, dict[str, Any]] = {}
        for (owner, key), value in values.items():
            if owner:
                per_detector.setdefault(owner, {})[key] = value
        scale_value = values.get(("", "scale"))
        if not n or loss_sum is None:
            return None, per_detector, scale_value
        if isinstance(loss_sum, torch.Tensor):
            total = values.get(("", "loss"))
            return (None if total is None else total / n), per_detector, scale_value
        return float(loss_sum) / n, per_detector, scale_value

    def close_step(self, rank: int, step: int, now: float, progress: Progress, loss: float | None,
                   readout: dict[str, dict[str, Any]], skipped: bool, loss_scale: float | None) -> StepEvent:
        """The step's event (``now``: the boundary's perf_counter); the next step starts from zero."""
        event = StepEvent(
            rank=rank,
            step=step,
            loss=loss,
            step_time_s=(now - self.t_last) if self.t_last is not None else 0.0,
            backward_calls=self.backward_calls,
            collectives=progress.collective_seq - self.seq_at_boundary,
            backward_total=self.backward_total,
            readout=readout,
            skipped=skipped,
            loss_scale=loss_scale,
        )
        self.t_last = now
        self.loss_sum, self.loss_n, self.raw_sum = None, 0, None
        self.scaled = []
        self.backward_calls = 0
        self.reduced_at = False
        self.seq_at_boundary = progress.collective_seq
        return event


def step_record(event: StepEvent, attempt: int, skipped: bool, off: bool) -> dict:
    """The step's record in the rank's event stream (``off``: a --measure-overhead block without the harness)."""
    return schema.record(
        schema.STEP,
        rank=event.rank,
        step=event.step,
        attempt=attempt,
        time=time.time(),
        loss=event.loss,
        step_time_s=round(event.step_time_s, 6),
        backward_calls=event.backward_calls,
        collectives=event.collectives,
        **({"skipped": True} if skipped else {}),
        **({"harness": "off"} if off else {}),
        **({"loss_scale": event.loss_scale} if event.loss_scale is not None else {}),
    )


def bare_step_record(rank: int, step: int, attempt: int) -> dict:
    """A step seen only afterwards (a new phase's first optimizer step): nothing of it was counted."""
    return schema.record(schema.STEP, rank=rank, step=step, attempt=attempt, time=time.time(), loss=None,
                         step_time_s=0.0, backward_calls=0, collectives=0)
