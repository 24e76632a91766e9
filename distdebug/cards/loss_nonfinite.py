"""loss_nonfinite: a loss that is NaN or Inf, per rank."""

from __future__ import annotations

from distdebug.cards.base import LOSS_X10, Card, Variant

CARD = Card(
    code="DD101", name="loss_nonfinite", family="numerics", source="detector (on every rank, every step)",
    title="loss is NaN or Inf: names the first step per rank",
    severities=("error",),
    meaning="The loss a rank computed was NaN or Inf. On its own it says when, not where: nan_origin names the "
            "rank and module it started on.",
    subjects="`loss`",
    causes=("non-finite gradients (overflow, division by zero, log of 0)", "a failed gradient sync",
            "a NaN on another rank, spread by the all-reduce"),
    check="the nan_origin finding of the same step: the first module and tensor",
    fix="lower the learning rate, clip gradients before they overflow (not after: clipping cannot repair "
        "Inf/NaN), check the batch and the loss for log(0)/x/0",
    kind="nonfinite", noun="the non-finite loss",
    faults=("nan_grad", "nan_activation"),
    cost="the loss's finiteness, in the one read a step the harness makes",
    variants=(
        Variant("any", LOSS_X10,
                "non-finite gradients (overflow, division by zero, log of 0) or a failed gradient sync",
                "nan_origin's finding names the first module and tensor; rerun that rank with "
                "torch.autograd.set_detect_anomaly(True) around that step for the operation",
                "lower the learning rate and clip gradients before they overflow (clip_grad_norm_ after backward: DDP "
                "already averaged them, no rescaling by world size; clipping cannot repair a gradient already Inf/NaN: "
                "skip that step, as GradScaler does, or clip_grad_norm_(..., error_if_nonfinite=True) to stop); "
                "check the batch and the loss for log(0)/x/0"),
    ),
)
