"""nan_origin: where the first NaN/Inf was born (rank, step, module or tensor)."""

from __future__ import annotations

from distdebug.cards.base import LOSS_X10, Card, Option, Variant
from distdebug.config import NanOriginConfig

CARD = Card(
    code="DD102", name="nan_origin", family="numerics", source="detector (on every rank, every step)",
    title="first NaN/Inf: step, origin rank (local gradients before all-reduce), first parameter in backward, "
          "first module in forward",
    severities=("warning", "error", "critical"),
    meaning="The first value that became NaN or Inf, and where it was born: the rank whose local gradients were "
            "non-finite before the all-reduce spread them, the first module whose forward output was non-finite "
            "(re-executed on demand), or parameters and buffers that were never finite. The other ranks are told "
            "they only received it.",
    subjects="the module or tensor where it was born (a module's name, a parameter's name, `loss`); `gradients` on "
             "the ranks that only received it; `non-finite steps` for a run that never recovered",
    causes=("a numerically unstable operation (log of 0, division by zero, overflow in fp16/bf16)",
            "a bad batch (an empty sequence, an infinite feature)",
            "a learning rate too high, or gradients not clipped",
            "parameters or buffers loaded or initialised non-finite"),
    check="the finding names the first module and tensor; rerun that rank with torch.autograd.set_detect_anomaly(True) "
          "around that step for the operation",
    fix="guard the loss against log(0) and x/0, lower the learning rate, clip gradients before they overflow "
        "(clipping cannot repair a gradient already Inf/NaN: skip that step); stop early with "
        "`distdebug attach --stop-on-nan`",
    kind="nan", noun="the NaN/Inf",
    faults=("nan_grad", "nan_activation"),
    options=(Option("stop", NanOriginConfig.stop, "end the job (exit 123) at the first non-finite value",
                    "--stop-on-nan"),
             Option("watch", NanOriginConfig.watch, "on-demand: a non-finite step is re-executed with every module "
                    "watched; full: every module's output is checked in every step", "--nan-watch")),
    cost="one finiteness reduction per step over the loss, local gradients and parameters, read once a step; "
         "on-demand mode holds one copy of the step's inputs and parameters",
    variants=(
        Variant("the rank only received the NaN through a collective (evidence origin: another rank)", LOSS_X10,
                "{ranks} only received the NaN/Inf: another rank's gradients were non-finite and the all-reduce "
                "spread them", "the nan_origin finding that says 'started on'",
                "fix the origin rank; nothing to do on this one",
                when=lambda f, c: (f.evidence or {}).get("origin") == "another rank"),
        Variant("parameters or buffers were non-finite before any step (evidence nonfinite_state)", LOSS_X10,
                "parameters or buffers on {ranks} were non-finite[[ {ev[checked]}]], before any step"
                "[[: {ev[likely_cause]}]]",
                "the finding's tensors (evidence: nonfinite_state)",
                "initialise or load finite values into the named tensors before training", own_fix=True,
                when=lambda f, c: bool((f.evidence or {}).get("nonfinite_state"))),
        Variant("the run never recovered (subject: non-finite steps)", LOSS_X10,
                "the run never recovered: once the weights hold NaN/Inf every later step is non-finite too",
                "the first nan_origin finding (where it started)",
                "stop such runs early: distdebug attach --stop-on-nan; restart from the last good checkpoint",
                when=lambda f, c: f.subject == "non-finite steps"),
        Variant("where the NaN/Inf was born", LOSS_X10,
                "a numerically unstable op or a bad batch on {ranks}, spread to every rank by the gradient "
                "all-reduce",
                "nan_origin's finding names the first module and tensor; rerun that rank with "
                "torch.autograd.set_detect_anomaly(True) around that step for the operation",
                "lower the learning rate and clip gradients before they overflow (clip_grad_norm_ after backward: DDP "
                "already averaged them, no rescaling by world size; clipping cannot repair a gradient already Inf/NaN: "
                "skip that step, as GradScaler does, or clip_grad_norm_(..., error_if_nonfinite=True) to stop); "
                "check the batch and the loss for log(0)/x/0"),
    ),
)
