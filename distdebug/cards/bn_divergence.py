"""bn_divergence: BatchNorm running statistics that differ across ranks."""

from __future__ import annotations

from distdebug.cards.base import LOSSES_DIFFER, Card, Variant

CARD = Card(
    code="DD202", name="bn_divergence", family="replicas", source="detector (on every rank, every step)",
    title="BatchNorm running statistics differ across ranks (names module, max difference); plain BatchNorm in "
          "DDP without synced statistics",
    severities=("warning", "error"),
    meaning="A BatchNorm module's running_mean/running_var differ across ranks: each rank normalises with its "
            "own batch's statistics and keeps its own buffers, so evaluation (which uses the buffers) differs by "
            "rank.",
    subjects="the BatchNorm module's name",
    causes=("plain BatchNorm under DDP with broadcast_buffers=False", "SyncBatchNorm not used where the "
            "per-rank batch is small", "replicas that already diverged compute different statistics"),
    check="compare running_mean across ranks (the finding's evidence)",
    fix="SyncBatchNorm.convert_sync_batchnorm(model) before wrapping in DDP, or keep broadcast_buffers=True",
    kind="statistics", noun="the BatchNorm statistics that differ",
    faults=("unsynced_bn",),
    cost="a fingerprint of each BatchNorm buffer per step, in the same exchange as the replicas'",
    variants=(
        Variant("any", LOSSES_DIFFER,
                "BatchNorm statistics not synced: each rank normalises with its own batch's statistics and keeps "
                "its own running_mean/var",
                "compare running_mean across ranks (the finding's evidence)",
                "SyncBatchNorm.convert_sync_batchnorm(model) before wrapping in DDP, or keep broadcast_buffers=True"),
    ),
)
