"""loss_spike: a loss or gradient norm far above its recent median, or one rank's loss apart from the others'."""

from __future__ import annotations

from distdebug.cards.base import LOSS_X10, LOSSES_DIFFER, RESTORE, Card, Option, Variant
from distdebug.config import LossSpikeConfig

CARD = Card(
    code="DD103", name="loss_spike", family="numerics", source="detector (on every rank, every step)",
    title="loss or gradient norm far above its recent median (robust z over a window), per rank",
    severities=("info", "warning", "error"),
    meaning="A rank's loss or gradient norm jumped far above its recent median (a robust z: median and MAD over "
            "a window), or one rank's loss departed from the other ranks' at the same step.",
    subjects="`loss`, `grad_norm` or `loss across ranks`",
    causes=("a bad batch", "a learning rate too high", "a failed gradient sync",
            "a checkpoint restored wrongly (after a restore)", "a rank with other data or state than the others"),
    check="`distdebug diff RUN --step N`: do the replicas still agree at that step?",
    fix="check the clipping threshold and the learning-rate schedule; skip or inspect that batch",
    kind="spike", noun="the loss spike",
    faults=("loss_spike",),
    options=(Option("threshold", LossSpikeConfig.threshold, "robust z above which a value is a spike",
                    "--spike-threshold"),
             Option("window", LossSpikeConfig.window, "steps of history a spike is measured against",
                    "--spike-window")),
    cost="a few floats a step from the loss the harness already reads",
    variants=(
        Variant("one rank's loss departs from the other ranks' (evidence median_of_other_ranks)", LOSSES_DIFFER,
                "{ranks} trained on different data or state than the others: a bad batch, BatchNorm statistics not "
                "synced, or seeds not fixed",
                "distdebug diff {run_dir}{at}; compare BatchNorm running_mean across ranks",
                "SyncBatchNorm.convert_sync_batchnorm(model) before DDP; seed every rank the same before building "
                "the model; DistributedSampler with set_epoch",
                when=lambda f, c: "median_of_other_ranks" in (f.evidence or {})),
        Variant("after a checkpoint restore (the incident's root is a checkpoint_roundtrip finding)", RESTORE,
                "the jump follows the checkpoint restore{root_when}: shards restored wrongly (wrong rank's file, "
                "missing optimizer state)",
                "distdebug report {run_dir}: checkpoint_roundtrip names the tensors that differ",
                "load through the sharding-aware API (DCP, engine.load_checkpoint), each rank its own shard",
                when=lambda f, c: c.root is not None and c.root.detector == "checkpoint_roundtrip",
                explains_root=True),
        Variant("any other spike", LOSS_X10,
                "a failed gradient sync, non-finite-adjacent gradients, a bad batch or a learning rate too high "
                "(after a restore: shards loaded wrongly)",
                "distdebug diff {run_dir}{at}: do the replicas still agree?",
                "check the clipping threshold and the learning-rate schedule; skip or inspect that batch"),
    ),
)
