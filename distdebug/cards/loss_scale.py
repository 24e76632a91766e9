"""loss_scale: an AMP loss scaler that skips steps or keeps collapsing."""

from __future__ import annotations

from distdebug.cards.base import LOSS_X10, NOTE, Card, Option, Variant
from distdebug.config import LossScaleConfig

CARD = Card(
    code="DD104", name="loss_scale", family="numerics", source="detector (on every rank, every step)",
    title="AMP loss scaler: steps skipped for overflow (info), a scale that keeps collapsing (warning)",
    severities=("info", "warning"),
    meaning="The mixed-precision loss scaler (torch.amp.GradScaler, DeepSpeed fp16) skipped steps because the "
            "scaled gradients overflowed. A few skips are how dynamic scaling works; a scale that keeps halving "
            "means the gradients overflow at any scale.",
    subjects="`skipped step` or `loss scale`",
    causes=("gradients that overflow fp16 at every scale (a NaN/Inf upstream, an exploding loss)",
            "a static loss scale too large", "a minimum scale too low (small gradients vanish)"),
    check="the steps skipped in a row and the scale's value in the finding's evidence; a nan_origin finding at "
          "the same steps",
    fix="find the overflow (nan_origin); bf16 instead of fp16 where the hardware has it; dynamic loss scaling "
        "(DeepSpeed: loss_scale 0) with a sane initial scale",
    kind="scale", noun="the loss scaler's skipped steps",
    faults=(),
    options=(Option("skipped_in_a_row", LossScaleConfig.skipped_in_a_row,
                    "consecutive skipped steps after which the scale is said to keep collapsing"),
             Option("min_scale", LossScaleConfig.min_scale, "a scale below this is a warning")),
    cost="reads the scaler's state the script already keeps, once a step",
    variants=(
        Variant("a skipped step or a count of them (info)", NOTE,
                "dynamic loss scaling: the scaled gradients overflowed, the scaler skipped the step and lowered the "
                "scale (normal a few times early in training)",
                "how many steps were skipped, and whether they keep coming (the warning)",
                "nothing, unless the steps keep being skipped",
                when=lambda f, c: f.severity == "info", own_fix=True),
        Variant("the scale keeps collapsing (warning)", LOSS_X10,
                "the gradients overflow at every scale: a NaN/Inf upstream or an exploding loss, so every step is "
                "skipped and the model stops learning",
                "the nan_origin finding at these steps; the scale in the evidence",
                "find the overflow (nan_origin's module); bf16 instead of fp16; lower the learning rate",
                own_fix=True),
    ),
)
