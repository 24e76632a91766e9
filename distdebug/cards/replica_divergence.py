"""replica_divergence: data-parallel replicas whose parameters (or gradients, or optimizer state) differ."""

from __future__ import annotations

from distdebug.cards.base import LOSSES_DIFFER, Card, Option, Variant
from distdebug.config import ReplicaDivergenceConfig

CARD = Card(
    code="DD201", name="replica_divergence", family="replicas", source="detector (cross-rank fingerprints every "
    "step); also `distdebug diff` and the check after the job",
    title="data-parallel replicas differ: first step, tensor names and odd rank(s) (cross-rank fingerprints)",
    severities=("error",),
    meaning="Ranks that should hold the same tensor (data-parallel replicas of a parameter, its gradient after "
            "the reduction, its optimizer state) hold different bits: the first step they differ, the tensors, and "
            "the rank(s) that are the odd ones out. Or a rank skipped or repeated optimizer.step (subject "
            "`optimizer step count`).",
    subjects="the first tensor that differs (a parameter, `grad:NAME`, `optimizer:NAME.exp_avg`), or `optimizer "
             "step count`",
    causes=("a skipped or partial gradient all-reduce", "a rank-local code path around backward or optimizer.step()",
            "a corrupted parameter (a bit flip: silent data corruption)", "different initial weights (init_seed)",
            "BatchNorm buffers not synced (bn_divergence)"),
    check="`distdebug diff RUN --step N`: the tensors that differ and the first divergent step",
    fix="make every rank run the same collectives in the same order; no rank-dependent branches around "
        "optimizer.step(); on a bit flip, take that GPU out of the pool",
    kind="replica", noun="the replica divergence",
    faults=("skip_step", "bitflip_param"),
    options=(Option("every", ReplicaDivergenceConfig.every, "cross-rank check every K optimizer steps",
                    "--fingerprint-every"),
             Option("state_every", ReplicaDivergenceConfig.state_every, "gradients and optimizer state join the "
                    "check at the first state_every checked steps and every state_every-th after")),
    cost="a 64-bit fingerprint per tensor per checked step, computed on the device (no copy to the host) and "
         "exchanged in one small collective; about 20 bytes a tensor a step on disk, within the run budget",
    variants=(
        Variant("a rank skipped or repeated optimizer.step (subject: optimizer step count)", LOSSES_DIFFER,
                "{ranks} skipped or repeated optimizer.step(): their steps no longer line up with the others'",
                "the finding's evidence: each rank's step and backward count",
                "every rank must call optimizer.step() once per step (look for rank-dependent conditions around it)",
                when=lambda f, c: f.subject == "optimizer step count", own_fix=True),
        Variant("any tensor that differs", LOSSES_DIFFER,
                "{ranks} applied a different update: a skipped or partial gradient all-reduce, a rank-local code "
                "path, or a corrupted parameter (bit flip)",
                "distdebug diff {run_dir}{at} (the tensors that differ, first divergent step)",
                "make every rank run the same collectives in the same order; no rank-dependent branches around "
                "optimizer.step(); on a bit flip, take that GPU out of the pool"),
    ),
)
