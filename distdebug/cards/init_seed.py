"""init_seed: initial parameters that differ across ranks, or torch's generator left unseeded."""

from __future__ import annotations

from distdebug.cards.base import LOSSES_DIFFER, REPRODUCE, Card, Variant

CARD = Card(
    code="DD203", name="init_seed", family="replicas", source="detector (once, before the first step)",
    title="initial parameters that differ across ranks (named; before DDP's broadcast too), unseeded torch",
    severities=("info", "error"),
    meaning="Before the first step, ranks built different initial parameters (named), which DDP hides by "
            "broadcasting rank 0's at wrap time but FSDP, tensor parallelism and hand-written loops do not; or "
            "torch's generator was seeded from the OS, so no two runs draw alike.",
    subjects="the first parameter that differs, or `torch.manual_seed`",
    causes=("seeds not fixed (or fixed per rank) before the model is built", "ranks restored different values "
            "from a checkpoint before the first step"),
    check="`distdebug diff RUN --step 1`",
    fix="torch.manual_seed(seed) on every rank before building the model",
    kind="seed", noun="the initial weights that differ",
    faults=("seed_mismatch",),
    cost="one fingerprint per parameter, once",
    variants=(
        Variant("torch's generator is not seeded (subject torch.manual_seed): no effect on the replicas",
                REPRODUCE, "torch's generator is seeded from the OS: no two runs draw alike (the replicas are not "
                "affected)", "the seeds in the finding's evidence",
                "torch.manual_seed(seed) (and random/numpy seeds) at the start, or distdebug attach --deterministic",
                when=lambda f, c: f.subject == "torch.manual_seed", kind="other"),
        Variant("after a checkpoint restore (the incident's root is a checkpoint_roundtrip finding)", LOSSES_DIFFER,
                "the ranks restored different values from a checkpoint before the first step (see the "
                "checkpoint_roundtrip finding), not their seeds",
                "the checkpoint_roundtrip finding's tensor and files",
                "load through the sharding-aware API, each rank its own shard",
                when=lambda f, c: c.root is not None and c.root.detector == "checkpoint_roundtrip",
                explains_root=True),
        Variant("initial weights that differ", LOSSES_DIFFER,
                "seeds not fixed: ranks built different initial weights", "distdebug diff {run_dir} --step 1",
                "torch.manual_seed(seed) on every rank before building the model (DDP broadcasts rank 0's weights "
                "at construction; FSDP1 only with sync_module_states=True; FSDP2, tensor parallelism and hand-written "
                "loops never)"),
    ),
)
