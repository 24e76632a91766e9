"""config_lint: a DDP, FSDP or DeepSpeed setting that wastes time or silently changes training."""

from __future__ import annotations

from distdebug.cards.base import CONFIG, Card, Variant

CARD = Card(
    code="DD504", name="config_lint", family="environment", source="detector (on the live DDP/FSDP/DeepSpeed "
    "objects); also from a rank's error (the launcher)",
    title="lint's checks on the live DDP/DeepSpeed objects (unused parameters, buffers, wrap order, buckets)",
    severities=("info", "warning", "error"),
    meaning="A framework setting that runs but trains wrong or slow: find_unused_parameters where none are unused "
            "(an extra pass a step), broadcast_buffers=False with BatchNorm (statistics per rank), torch.compile "
            "before DDP, bucket sizes, DeepSpeed's batch arithmetic, clip_grad_norm_ on FSDP1 parameters, a "
            "gradient detached in DDP's bucket. The same checks as `distdebug lint`, on the objects themselves.",
    subjects="the setting (`broadcast_buffers`, `find_unused_parameters`, `bucket_cap_mb`, ...)",
    causes=("a setting copied from another model or framework version", "a default that does not fit this model"),
    check="`distdebug lint SCRIPT` (the same check on the source)",
    fix="follow the finding's fix",
    kind="other", noun="the configuration",
    cost="once, when the wrapper is built",
    variants=(
        Variant("the rank raised it (evidence raised: DDP refused the setting at run time)", CONFIG,
                "a DDP/FSDP/DeepSpeed setting the framework refused at run time: the rank raised and the others "
                "were left waiting", "the rank's error in the finding's message; distdebug lint SCRIPT",
                "follow the finding's fix", own_fix=True,
                when=lambda f, c: bool((f.evidence or {}).get("raised")), kind="crash"),
        Variant("broadcast_buffers=False with BatchNorm: causes per-rank statistics", CONFIG,
                "a DDP/FSDP/DeepSpeed setting that wastes time or silently changes training",
                "distdebug lint SCRIPT (the same check on the source)", "follow the finding's fix",
                when=lambda f, c: f.subject == "broadcast_buffers", kind="config"),
        Variant("any other setting", CONFIG, "a DDP/FSDP/DeepSpeed setting that wastes time or silently changes "
                "training", "distdebug lint SCRIPT (the same check on the source)", "follow the finding's fix"),
    ),
)
