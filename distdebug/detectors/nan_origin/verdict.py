"""The verdict, on the rare path only (the step's one read said something is non-finite): the step's
flags read one by one, and the judgement: never finite (state.py), written between steps (replay.py),
received through communication (a pipeline stage's input, an FSDP2 all-gather, a TP layer's collectives,
the gradients' all-reduce) or born here, and the finding's wording; AMP's skipped steps and
``--stop-on-nan``.

Why a module of its own: what is recorded in every step (watch.py, gradients.py, collectives.py) is device
flags; what they mean, and how a reader is told, is decided here alone."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from distdebug.config import EXIT_NAN
from distdebug.context import StepEvent
from distdebug.detectors.nan_origin.flags import all_finite
from distdebug.detectors.nan_origin.replay import Replay
from distdebug.detectors.nan_origin.state import StateChecks
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.hashing import local_view


class Verdict(Replay, StateChecks):
    """``on_step``: whether the step is a finding, and which one."""

    _checked_step = 0
    _previous_checked = True

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        if self.ctx is None:
            return ()
        # Whether the step before this one was checked: it is not when --measure-overhead ran it without the
        # detectors, and then parameters found non-finite now may have been written by its update.
        self._previous_checked, self._checked_step = self._checked_step == event.step - 1, event.step
        fwd, local = self._step_records
        self._step_records = ([], [])
        comm_in, comm_out, stage_input, shards, gathered = self._forward_records
        self._forward_records = ({}, {}, {}, {}, {})
        values = self.values(event)
        forward = values.get("forward")
        forward = None if forward is None else (0.0 if all_finite(forward) else math.inf)
        finite = forward != math.inf and all_finite(values.get("rest", ()))
        loss_finite = event.loss is None or math.isfinite(event.loss)
        checks, self._state_records = self._state_records, []
        if finite and loss_finite:
            return ()
        never = self._never_finite(event, checks)
        if never is not None:
            return self._emit(never) if self._first_of_run(event) else ()
        skipped = event.skipped and loss_finite
        localised = self._recorder is not None and (skipped or self.first_step is None)
        if localised:  # on-demand watch: the step's forward again, every module watched (the rare path)
            fwd, self._localised = self._localise(event.step)
            if fwd:
                forward = float(torch.stack([v for _, v in fwd]).amax())  # one read
        forward_finite = forward is None or math.isfinite(forward)
        if loss_finite and forward_finite and not skipped and not self._nonfinite_now():
            # The norms said non-finite, the values say finite: a finite gradient or parameter past ~1e19,
            # whose float32 square overflowed in its 2-norm (runtime.localgrads). Not a NaN/Inf.
            return ()
        if skipped and forward_finite:
            # A loss scaler found non-finite (scaled) gradients and skipped the update, as it is meant
            # to: the forward and the loss were finite, the parameters did not change. Not a NaN of the
            # training's; the flags are cleared, so nothing carries into the next step (loss_scale says it).
            return ()
        if not self._first_of_run(event):
            return ()
        finding = (self._before(event) or self._received(event, fwd, comm_in, comm_out, stage_input, shards, gathered)
                   or self._explain(event, fwd, local))
        if event.skipped:  # the non-finite forward or loss made the scaled gradients overflow too
            finding.message += ("; the loss scaler skipped this step's update (its scaled gradients were non-finite), "
                                "but the forward or the loss was already non-finite: not an overflow of the scale")
            finding.evidence["loss_scaler_skipped_step"] = True
        if localised and finding.evidence.get("first_nonfinite_module_output") is None:
            finding.evidence["localisation"] = self._localised or (
                "the step's forward, re-executed on this rank from its inputs and parameters, was finite in every "
                "watched module: the non-finite value did not come from the forward again (a transient fault: "
                "--rerun-on-anomaly tells; or it was born in the backward or the update)")
        return self._emit(finding)

    def _first_of_run(self, event: StepEvent) -> bool:
        """Count a non-finite step; whether it is the run's first (the one found; later ones are counted)."""
        self.count += 1
        if self.first_step is not None:
            return False
        self.first_step = event.step
        return True

    def _emit(self, finding: Finding) -> tuple[Finding, ...]:
        """The run's first finding, with the watch that ran; --stop-on-nan ends the rank once it is written."""
        finding.evidence["watch"] = self.watch
        if self.stop and self.ctx is not None:
            self.ctx.report(finding)
            raise SystemExit(EXIT_NAN)
        return (finding,)

    def _nonfinite_now(self) -> bool:
        """Whether a gradient (as reduced) or a parameter holds a NaN or Inf (the rare path: read here)."""
        for _, p in self.params:
            for t in (p, p.grad):
                if t is not None and t.numel() and not bool(local_view(t).isfinite().all()):
                    return True
        return False

    def _received(self, event: StepEvent, fwd: list[tuple[str, torch.Tensor]], comm_in: dict[str, torch.Tensor],
                  comm_out: dict[str, torch.Tensor], stage_input: dict[str, torch.Tensor],
                  shards: dict[str, torch.Tensor], gathered: dict[str, torch.Tensor]) -> Finding | None:
        """A NaN that came into this rank in the forward, through communication: a pipeline stage's input
        from the previous stage, or a tensor-parallel layer whose local result was finite and whose output
        after torch's all-reduce / redistribution was not. Not an origin: a warning naming how it came.
        (Read only on the rare path, after the step's one read said something is non-finite.)"""
        step = event.step
        bad_input = next((n for n, v in stage_input.items() if not math.isfinite(float(v))), None)
        stage = self.stage or {}
        if bad_input is not None:
            prev = stage.get("index", 1) - 1
            ranks = stage.get("ranks") or []
            src = f" (rank {ranks[prev % len(ranks)]})" if ranks else ""
            return self._received_finding(
                event, bad_input, f"(pipeline stage {stage.get('index')}) at step {step} in its input, received "
                f"from pipeline stage {prev}{src}", "pipeline receive", None, from_stage=prev)
        bad_module = next((name for name, total in fwd if not math.isfinite(float(total))), None)
        if bad_module is None:
            return None
        bad_gather = next((lbl for lbl, v in gathered.items() if not math.isfinite(float(v))
                           and (not lbl or bad_module == lbl or bad_module.startswith(lbl + "."))
                           and lbl in shards and math.isfinite(float(shards[lbl]))), None)
        if bad_gather is not None:
            return self._received_finding(
                event, bad_module, f"at step {step} through FSDP's parameter all-gather of "
                f"{bad_gather or 'the root module'}: this rank's shards were finite and the gathered parameters "
                "were not (another rank's shard is non-finite)", "FSDP parameter all-gather", bad_module)
        sent, got = comm_in.get(bad_module), comm_out.get(bad_module)
        if sent is None or got is None or not math.isfinite(float(sent)) or math.isfinite(float(got)):
            return None  # born here (also when a forward hook of the module's own, not the communication, made it)
        return self._received_finding(
            event, bad_module, f"at step {step} through the forward communication of tensor-parallel module "
            f"{bad_module}: what this rank gave its all-reduce / redistribution was finite and what came back "
            "from its TP peers was not", "tensor-parallel forward communication", bad_module)

    def _received_finding(self, event: StepEvent, subject: str, how: str, through: str, module: str | None,
                          **evidence: Any) -> Finding:
        return Finding(
            severity=Severity.WARNING, detector=self.name, ranks=[event.rank], step=event.step, subject=subject,
            message=f"NaN/Inf reached rank {event.rank} {how}: not born here; the origin is the rank whose "
                    "nan_origin finding says 'started on'",
            evidence={"origin": "another rank", "received_through": through,
                      "first_nonfinite_module_output": module, **evidence},
        )

    def _explain(self, event: StepEvent, fwd: list[tuple[str, torch.Tensor]],
                 local: list[tuple[tuple[str, ...], torch.Tensor]]) -> Finding:
        rank, step = event.rank, event.step
        loss_finite = event.loss is None or math.isfinite(event.loss)
        bad_module = next((name for name, total in fwd if not math.isfinite(float(total))), None)
        # Backward order runs from the last parameters to the first.
        bad_grads = [n for n, p in reversed(self.params)
                     if p.grad is not None and not bool(local_view(p.grad).isfinite().all())]
        # Parameters in a bucket (or all_reduce input) that was non-finite here before the reduction;
        # named by their gradients after it (the reduction spreads, it does not move, a NaN).
        suspects = {n for names, v in local for n in _nonfinite(names, v)}
        # A norm (runtime.localgrads) of a finite gradient past ~1e19 overflows float32: a parameter whose
        # reduced gradient is finite had a finite local one (a reduction spreads a NaN or Inf, it never
        # removes one), so it is no suspect. Flattened buffers keep their own names.
        nonfinite = set(bad_grads)
        finite_grads = {n for n, p in self.params if p.grad is not None and n not in nonfinite}
        bad_local = [n for n in bad_grads if n in suspects] or sorted(suspects - finite_grads)
        bad_params = [n for n, p in self.params if not bool(local_view(p).isfinite().all())]
        evidence = {
            "loss": None if event.loss is None else str(event.loss),
            "first_nonfinite_module_output": bad_module,
            "local_gradients_nonfinite": bad_local[:50],
            "local_gradients_seen_by": self.local_source,
            "reduced_gradients_nonfinite": bad_grads[:50],
            "parameters_nonfinite_after_step": bad_params[:50],
        }
        where = []
        if bad_module:
            where.append(f"first non-finite module output in forward order: {bad_module}")
        if event.loss is not None and not math.isfinite(event.loss):
            where.append(f"loss {event.loss}")
        fix = ("look at the named module's inputs and weights at that step (a log of a non-positive number, a "
               "division by zero, an overflow in fp16/bf16, a bad batch); lower the learning rate or clip "
               "gradients if the values grow before")
        if bad_local:
            where.insert(0, f"first parameter in backward order with a non-finite local gradient (before "
                            f"all-reduce): {bad_local[0]}")
            return Finding(
                severity=Severity.ERROR, detector=self.name, ranks=[rank], step=step,
                subject=bad_module or bad_local[0],  # where it was born: the forward's module, else the gradient
                message=f"NaN/Inf started on rank {rank} at step {step}: " + "; ".join(where),
                evidence={**evidence, "origin": "this rank"}, fix=fix,
            )
        if self.local_source and local and bad_grads:
            return Finding(
                severity=Severity.WARNING, detector=self.name, ranks=[rank], step=step, subject="gradients",
                message=f"non-finite gradients reached rank {rank} through all-reduce at step {step}; its own local "
                        f"gradients were finite (first non-finite after reduction: {bad_grads[0]}): the origin is "
                        "the rank whose nan_origin finding says 'started on'",
                evidence={**evidence, "origin": "another rank"},
            )
        if self.framework_reduces:
            # FSDP2 and DeepSpeed reduce gradients inside: local gradients cannot be seen, but the forward
            # and the loss come before any reduction. A rank whose forward made the first non-finite output
            # (or whose loss was) is where it started; one whose forward and loss were finite received it.
            if bad_module is not None or not loss_finite:
                if bad_module is not None:
                    where[0] += " (before any gradient reduction)"
                if bad_grads:
                    where.append(f"first non-finite gradient in backward order: {bad_grads[0]}")
                return Finding(
                    severity=Severity.ERROR, detector=self.name, ranks=[rank], step=step,
                    subject=bad_module or "loss",
                    message=f"NaN/Inf started on rank {rank} at step {step}: " + "; ".join(where),
                    evidence={**evidence, "origin": "this rank (forward)"}, fix=fix,
                )
            if bad_grads or bad_params:
                return Finding(
                    severity=Severity.WARNING, detector=self.name, ranks=[rank], step=step, subject="gradients",
                    message=f"non-finite gradients reached rank {rank} at step {step} through the framework's gradient "
                            f"reduction; its own forward outputs and loss were finite (first non-finite gradient: "
                            f"{bad_grads[0] if bad_grads else '-'}): the origin is the rank whose nan_origin finding "
                            "says 'started on' (if none does, a backward produced it)",
                    evidence={**evidence, "origin": "another rank"},
                )
        if self._tp and bad_module is None and loss_finite and (bad_grads or bad_params):
            # Tensor parallel: the forward and the loss were finite here, the gradients were not. The TP
            # layers' backward all-reduces the input gradients across the TP peers: it came from one of them.
            return self._received_finding(
                event, "gradients", f"at step {step} in the backward, through the tensor-parallel layers' gradient "
                f"all-reduce with its TP peers: its forward outputs and loss were finite (first non-finite "
                f"gradient: {bad_grads[0] if bad_grads else '-'})", "tensor-parallel backward communication", None)
        subject = bad_module or (bad_grads[0] if bad_grads else bad_params[0] if bad_params else "loss")
        if bad_grads:
            where.append(f"first non-finite gradient in backward order: {bad_grads[0]}")
        if bad_params:
            where.append(f"first non-finite parameter after the step: {bad_params[0]}")
        unknown = "" if self.local_source else " (gradients are reduced inside the framework here, so the rank " \
                                                "it started on cannot be told from local gradients)"
        return Finding(
            severity=Severity.ERROR, detector=self.name, ranks=[rank], step=step, subject=subject,
            message=f"NaN/Inf on rank {rank} at step {step}: " + ("; ".join(where) or "non-finite values") + unknown,
            evidence={**evidence, "origin": "unknown" if not self.local_source else "this rank"}, fix=fix,
        )


def _nonfinite(names: tuple[str, ...], v: torch.Tensor) -> list[str]:
    """The names whose value in ``v`` is non-finite: one value per name (end-of-backward reading), or one
    for all of them (a bucket or an all_reduce input). Rare path: reads the values."""
    values = v.reshape(-1).tolist()
    if len(values) == len(names):
        return [n for n, x in zip(names, values, strict=True) if not math.isfinite(x)]
    return list(names) if not all(math.isfinite(x) for x in values) else []
