"""data_order: ranks that read the same samples, an epoch that repeats an earlier one's order, one batch
that gave different losses."""

from __future__ import annotations

from distdebug.cards.base import CONFIG, LOSSES_DIFFER, Card, Variant

CARD = Card(
    code="DD204", name="data_order", family="replicas", source="detector (on every rank, every step)",
    title="ranks training on identical batches (DistributedSampler missing), DistributedSampler without set_epoch, "
          "the same batch giving different losses",
    severities=("warning", "error"),
    meaning="The data each rank trained on was not what data parallelism needs: every rank read the same "
            "batches (each repeats the others' work), an epoch repeated an earlier epoch's order, or ranks that "
            "read the same batch computed different losses (the replicas are not the same model).",
    subjects="`input batches`, `DistributedSampler.set_epoch` or `loss`",
    causes=("a DataLoader without a DistributedSampler (or one without rank and world size)",
            "sampler.set_epoch(epoch) not called before each epoch", "replicas that are not the same model"),
    check="the finding's evidence: the steps at which every rank's batch fingerprint was the same",
    fix="DistributedSampler(dataset, num_replicas=world, rank=rank) and sampler.set_epoch(epoch)",
    kind="data", noun="the duplicated data",
    faults=("duplicate_data",),
    cost="a fingerprint of each step's input batch, exchanged with the replicas' fingerprints",
    variants=(
        Variant("an epoch repeated an earlier one's order (subject DistributedSampler.set_epoch)", CONFIG,
                "an epoch trained on the same sample order as an earlier one: set_epoch(epoch) not called before "
                "iterating the DataLoader (the order is a function of seed and epoch)",
                "the finding's evidence: where the repeating pass and the earlier one were iterated, and the steps "
                "each was first trained on; a set_epoch call before the loop at 'where'",
                "sampler.set_epoch(epoch) at the start of every epoch, before the loop",
                when=lambda f, c: f.subject == "DistributedSampler.set_epoch"),
        Variant("the same batch gave different losses (subject loss)", LOSSES_DIFFER,
                "the same batch gave different losses on different ranks: the replicas are not the same model "
                "(initialisation, seeds, an unsynchronised update) or not deterministic",
                "the finding's evidence: each rank's loss at that step; distdebug diff {run_dir}{at}",
                "seed every rank alike and broadcast the initial parameters (DDP does at construction)",
                when=lambda f, c: f.subject == "loss"),
        Variant("ranks read the same samples (subject input batches)", LOSSES_DIFFER,
                "ranks read the same samples: a sampler without rank/world size (DistributedSampler missing), so "
                "each rank repeats the others' work",
                "the finding's evidence: the steps at which every rank's batch fingerprint was the same",
                "DistributedSampler(dataset, num_replicas=world, rank=rank) and sampler.set_epoch(epoch)"),
    ),
)
