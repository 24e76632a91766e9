"""checkpoint_roundtrip: a restore that read other tensors than the save wrote, or another rank's shard."""

from __future__ import annotations

from distdebug.cards.base import RESTORE, Card, Variant

CARD = Card(
    code="DD205", name="checkpoint_roundtrip", family="replicas", source="detector (at torch.save and torch.load)",
    title="a torch.load restores other tensors than torch.save wrote (names them), or another rank's shard",
    severities=("warning", "error"),
    meaning="What a rank restored is not what was saved: a fingerprint taken at torch.save does not match the "
            "tensors after the load, or the shard a rank loaded was saved by another rank.",
    subjects="the first tensor that differs",
    causes=("another rank's shard loaded", "a checkpoint rewritten or truncated between save and load",
            "optimizer state not restored"),
    check="the tensor named in the finding; the checkpoint files' sizes and times",
    fix="load through the sharding-aware API (DCP, engine.load_checkpoint), each rank its own shard; write "
        "checkpoints atomically (temp file, then rename)",
    kind="checkpoint", noun="the checkpoint restore",
    faults=("checkpoint_corruption",),
    cost="a fingerprint of each saved and loaded tensor, at save and load only",
    variants=(
        Variant("any", RESTORE,
                "shards restored wrongly: the restore read other bytes than the save wrote (another rank's shard, "
                "a rewritten or truncated file)",
                "the tensor named in the finding; the checkpoint files' sizes and times",
                "load through the sharding-aware API (DCP, engine.load_checkpoint), each rank its own shard; write "
                "checkpoints atomically (temp file, then rename)"),
    ),
)
