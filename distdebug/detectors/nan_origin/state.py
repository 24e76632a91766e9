"""Parameters and buffers that were never finite: each model checked whole before its first step (as
built, initialised or loaded) and right after each ``load_state_dict``, with the user's line of a
``to_empty()`` that left memory uninitialised.

Why a mechanism of its own: a tensor that is non-finite before training touched it is not an op's or a
batch's NaN, and saying "NaN at step 1 in module X" would send the reader to the wrong place; the finding
names the tensors and the likely cause (a partial load, a checkpoint holding NaN, ``to_empty`` without an
init). The checks are device work only, read with the step's one host read (watch.py, ``probe``)."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from distdebug.context import RankContext, StepEvent
from distdebug.detectors.nan_origin.collectives import fsdp_params
from distdebug.detectors.nan_origin.core import NanOriginState, StateCheck
from distdebug.detectors.nan_origin.flags import max_abs_each
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.hashing import local_view
from distdebug.runtime.callsite import user_line
from distdebug.runtime.discovery import unwrap

FIRST_CHECK = "before its first step (as built, initialised or loaded)"
MAX_STATE_CHECKS = 8
"""State checks (core.StateCheck) held until the next step boundary reads them: a script that loads in a loop keeps
the first ones and the last."""


class StateChecks(NanOriginState):
    """Checks of the whole state: queued at the first backward (gradients.py) and after each load, judged
    on the rare path (verdict.py) before anything else."""

    def setup(self, ctx: RankContext) -> None:
        """From the script's first line: each model's parameters and buffers as its first step's backward
        finds them (as built, initialised or loaded: a forward changes no parameter), and as each
        ``load_state_dict`` leaves them (device values, read with the step's one read); where ``to_empty``
        left memory uninitialised. Parameters that were never finite (a block that ``to_empty()``
        materialised and no ``reset_parameters`` reached; a checkpoint holding NaN) are then told as such, on
        each rank where they are, instead of as the first step's NaN loss. (Checked at the backward, not by a
        global forward hook: removing one later would recompile every compiled graph.)"""
        self.patch(ctx, torch.nn.Module, "load_state_dict", self._after_load)
        self.patch(ctx, torch.nn.Module, "to_empty", self._note_to_empty)

    def _after_load(self, original: Any) -> Any:
        det = self

        def load_state_dict(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = original(module, *args, **kwargs)
            det._check_state(module, "right after load_state_dict", user_line(),
                             list(getattr(out, "missing_keys", None) or []))
            return out
        return load_state_dict

    def _note_to_empty(self, original: Any) -> Any:
        det = self

        def to_empty(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = original(module, *args, **kwargs)
            det._to_empty_at = user_line() or "?"
            return out
        return to_empty

    def _check_state(self, module: torch.nn.Module, when: str, where: str, missing: list[str] | None = None,
                     buffers: bool = True) -> None:
        """Queue max |x| of each floating parameter and buffer of ``module`` (this rank's shard of a sharded
        one): device work only, read at the next boundary."""
        from torch.nn.parameter import is_lazy

        inner = unwrap(module)[0]
        # FSDP2: the module's parameters may be the gathered ones at this moment (in a step, between the
        # all-gather and the reshard): this rank's own shards are what it holds, and outlive the step.
        qualified = {id(m): n for n, m in inner.named_modules()}
        shards = {}
        for mod in inner.modules():
            for fp in fsdp_params(mod):
                info = fp._module_info
                owner = qualified.get(id(info.module))
                if owner is not None:
                    shards[f"{owner}.{info.param_name}" if owner else info.param_name] = fp.sharded_param
        tagged = [(n, shards.get(n, t), True) for n, t in inner.named_parameters()] + \
            [(n, t, False) for n, t in (inner.named_buffers() if buffers else ())]
        # not yet materialised (meta, a Lazy module's), or not floating (integer counters, quantised weights)
        named = [(n, t, p) for n, t, p in tagged if isinstance(t, torch.Tensor) and not is_lazy(t)
                 and t.is_floating_point() and t.device.type != "meta"]
        views = [(n, local_view(t), p, t) for n, t, p in named]
        views = [v for v in views if v[1].numel()]
        if not views:
            return
        views.sort(key=lambda v: not v[2])  # parameters first, then buffers
        n_params = sum(v[2] for v in views)
        with torch.no_grad():
            flags = max_abs_each([v for _, v, _, _ in views])
            if n_params < len(views):
                # A buffer may hold an infinity by design (an attention mask of -inf, a sentinel): only a NaN in
                # a buffer is never meant (max |x| is NaN when any value is NaN, Inf when an infinity is and none
                # is). No host value: the tail of the same vector.
                flags[n_params:] = flags[n_params:].nan_to_num(nan=math.nan, posinf=0.0)
        check = StateCheck(when=when, where=where, names=[n for n, _, _, _ in views], flags=flags,
                           refs=[weakref.ref(t) for _, _, _, t in views], missing=missing or [])
        if len(self._state) >= MAX_STATE_CHECKS:
            self._state[-1] = check
        else:
            self._state.append(check)

    def _never_finite(self, event: StepEvent, checks: list[StateCheck]) -> Finding | None:
        """Parameters or buffers that were non-finite before the first step or right after a load (the rare
        path: the checks' flags read here): named as such, with the likely cause, not as a NaN of the step."""
        for check in checks:
            bad = [n for n, x, ref in zip(check.names, check.flags.tolist(), check.refs, strict=True)
                   if not math.isfinite(x) and _still_nonfinite(ref())]
            if bad:
                break
        else:
            return None  # made finite after the check (a strict=False load, then the script's own init)
        rank, step = event.rank, event.step
        at = f" at {check.where}" if check.where else ""
        missing = [n for n in bad if any(k == n or k.endswith("." + n) or n.endswith("." + k) for k in check.missing)]
        if check.where and missing:
            cause = (f"not in the checkpoint loaded{at} (strict=False: its missing keys {', '.join(missing[:5])} were "
                     "left as they were" + (f", uninitialised after to_empty() at {self._to_empty_at}" if
                                             self._to_empty_at else "") + ")")
            fix = "initialise the tensors the checkpoint does not hold, after the load (or save them with it)"
        elif check.where:
            cause = (f"the checkpoint loaded{at} holds NaN/Inf in these tensors (saved from a run that had already "
                     "diverged, or written wrongly)")
            fix = ("load an earlier checkpoint, or find where this one became non-finite (distdebug report on the run "
                   "that saved it); check which tensors a partial load leaves as they were")
        elif self._to_empty_at:
            cause = (f"uninitialised memory: to_empty() at {self._to_empty_at} allocates the model's tensors without "
                     "initialising them, and these were never initialised after it (their modules' "
                     "reset_parameters() or the script's init_weights did not reach them)")
            fix = ("initialise every module after to_empty(): call reset_parameters() on each module that has one "
                   "and initialise the rest (the named tensors) explicitly, or load a checkpoint into them")
        else:
            cause = ("the tensors were never initialised (torch.empty, a model materialised from the meta device "
                     "without an init) or were written non-finite before the first step (a checkpoint loaded "
                     "without load_state_dict)")
            fix = "initialise the named tensors before training (or load a finite checkpoint into them)"
        head = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        return Finding(
            severity=Severity.ERROR, detector=self.name, ranks=[rank], step=step, subject=bad[0],
            message=f"parameters or buffers were non-finite on rank {rank} {check.when}{at}, before any training "
                    f"step changed them: {head} ({len(bad)} of {len(check.names)} tensors). Not an op's or a "
                    f"batch's NaN: every step from step {step} computes with them",
            evidence={"nonfinite_state": bad[:50], "checked": check.when, "loaded_at": check.where or None,
                      "to_empty_at": self._to_empty_at or None, "likely_cause": cause, "origin": "this rank",
                      "loss": None if event.loss is None else str(event.loss)},
            fix=fix,
        )


def _still_nonfinite(t: Any) -> bool:
    """Whether a tensor checked earlier still holds a NaN or Inf now (gone: as it was checked). Rare path."""
    if t is None:
        return True
    with torch.no_grad():
        v = local_view(t)
        if v.untyped_storage().nbytes() < (v.storage_offset() + v.numel()) * v.element_size():
            return True  # its memory was let go (a framework's freed buffer): as it was checked
        return bool(v.numel()) and not bool(v.isfinite().all())
