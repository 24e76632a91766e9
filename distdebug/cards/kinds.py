"""The causal model: what kind of finding can follow from what. One table for the incidents (which findings are
one problem, and its root) and for the report's advice ("probably a consequence of ...").

Kinds, not detectors: several sources find one kind of thing (env_check, env_diff and link_matrix are all the
environment), and one detector's findings can be of two kinds (a configuration note that causes nothing, and
broadcast_buffers=False, which causes per-rank BatchNorm statistics). Each card says its kind.

As PyTorch behaves: a NaN reaches every rank through the gradient all-reduce, then the replicas, the BatchNorm
statistics, the losses and the loss scaler; a restored shard that is not what was saved gives replicas, losses
and initial weights that differ; a rank that died (out of memory) leaves the others waiting in a collective.
"""

from __future__ import annotations

ORDER = ("config", "environment", "seed", "checkpoint", "data", "nan", "crash", "hang", "statistics", "replica",
         "verdict", "nonfinite", "spike", "scale", "other")
"""Kinds from the most root to the most downstream: an incident's root is its member of the earliest kind."""

CAUSES: dict[str, tuple[str, ...]] = {
    "config": ("statistics", "replica"),  # broadcast_buffers=False -> BatchNorm statistics -> replicas
    "seed": ("replica", "spike", "data"),  # different initial weights: replicas, losses that differ
    # a restored shard that is not what was saved: replicas, losses, NaNs, and (restored before the first step)
    # initial weights that differ across ranks
    "checkpoint": ("replica", "spike", "nan", "seed"),
    "nan": ("nan", "nonfinite", "replica", "spike", "scale", "statistics", "verdict"),
    "statistics": ("replica", "spike"),  # BatchNorm buffers differ -> the replicas' buffers, the losses
    # a replica that diverged (a skipped step, a flipped bit) -> its re-execution's verdict, its loss, and the
    # BatchNorm statistics its different weights then compute
    "replica": ("verdict", "spike", "statistics"),
    # a non-finite loss (where nan_origin did not say where it started): the scaler's skipped step, and after it
    # the weights the NaN reached (replicas, BatchNorm statistics, losses)
    "nonfinite": ("scale", "replica", "statistics", "spike"),
    # a rank that died (out of memory, an error it raised) -> the hang verdict that names it: the same rank, at or
    # after its step (the others' wait is the verdict's own story)
    "crash": ("hang",),
    "hang": ("other",),  # a hang -> the ranks' collective errors and stalls
    "environment": ("hang",),  # a bad variable (a network interface that is not there) -> ranks that never meet
    "spike": ("spike",),  # a corrupted step moves the weights: the next few steps' losses are off too
}
"""Cause kind -> the kinds it can produce (what is not listed here causes nothing else)."""

SPREADS = {("nan", "nan"), ("nan", "nonfinite"), ("nan", "replica"), ("nan", "scale"), ("nan", "spike"),
           ("nan", "statistics"), ("nonfinite", "scale"), ("nonfinite", "replica"), ("nonfinite", "statistics"),
           ("nonfinite", "spike"), ("seed", "replica"), ("seed", "spike"), ("checkpoint", "replica"),
           ("checkpoint", "seed"), ("checkpoint", "spike"), ("checkpoint", "nan"), ("statistics", "replica"),
           ("replica", "spike"), ("replica", "statistics"), ("seed", "data"), ("config", "statistics"),
           ("config", "replica"), ("hang", "other"), ("environment", "hang")}
"""Links whose effect may be on other ranks than its cause: what the all-reduce, a comparison across ranks
or the collective the others wait in carries from one rank to the rest."""

WINDOW = {("spike", "spike"): 8}
"""Links that hold only within this many steps after the cause: a spike's aftershocks (the loss still off while
the weights recover from the corrupted update), not a spike fifty steps later."""

LATER = {("nan", "spike"), ("nonfinite", "replica"), ("nonfinite", "statistics"), ("nonfinite", "spike")}
"""Links whose effect comes in a later step than its cause, never the same one: a loss spike in the NaN's own step
is more likely its cause than its effect; a non-finite loss reaches the weights (and what they compute) only
through that step's update."""

NOT_CONSEQUENCES = ("other", "verdict")
"""Kinds the report never calls "probably a consequence" of their incident's root, though the incidents group
them: a note of kind ``other`` (a straggler, the memory, distdebug's own trouble) merely happened beside a hang,
and a re-execution's verdict diagnoses the root rather than following from it."""


def caused_by(kind: str) -> list[str]:
    """The kinds that can cause ``kind``."""
    return [a for a, bs in CAUSES.items() if kind in bs]
