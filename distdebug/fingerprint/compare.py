"""Comparing fingerprints across ranks: which tensors differ, and which ranks are the odd ones out."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from distdebug.findings import Finding, Severity

_GROUP = re.compile(r"^(.*)@replicas\[([0-9,]*)\]$")


def with_group(name: str, ranks: list[int] | None) -> str:
    """A tensor name that says which ranks must agree on it (None: every rank, no suffix)."""
    return name if ranks is None else f"{name}@replicas[{','.join(map(str, ranks))}]"


def split_group(name: str) -> tuple[str, list[int] | None]:
    """(name as the user wrote it, the ranks that must agree on it; None: every rank)."""
    m = _GROUP.match(name)
    if m is None:
        return name, None
    return m[1], [int(x) for x in m[2].split(",") if x]


def odd_ones_out(values: dict[int, int]) -> tuple[list[int], bool]:
    """Ranks whose value differs from a strict majority (and True), or all ranks (and False) if none."""
    counts = Counter(values.values())
    value, n = counts.most_common(1)[0]
    if len(values) >= 3 and n > len(values) / 2:
        return sorted(r for r, v in values.items() if v != value), True
    return sorted(values), False


def compare(per_rank: dict[int, dict[str, int]], order: list[str]) -> list[dict[str, Any]]:
    """Tensors whose fingerprints differ across ranks, in ``order``, with culprits by majority.

    A name with a replica group (``w@replicas[0,2]``, see ``detectors.replica_set``) is compared among
    that group's ranks only; ``tensor`` in the result is the name as the user wrote it,
    ``replica_group`` the ranks that were compared (None: all)."""
    diffs = []
    seen = set(order)
    names = order + sorted({n for fps in per_rank.values() for n in fps} - seen)
    for name in names:
        base, group = split_group(name)
        members = per_rank if group is None else {r: per_rank.get(r, {}) for r in group}
        values = {r: fps[name] for r, fps in members.items() if name in fps}
        missing = sorted(r for r, fps in members.items() if name not in fps)
        if len(set(values.values())) > 1 or (missing and values):
            odd, by_majority = odd_ones_out(values) if len(set(values.values())) > 1 else (missing, True)
            diffs.append({"tensor": base, "ranks": odd, "by_majority": by_majority, "missing_on": missing,
                          "groups": _groups(values), "replica_group": group})
    return diffs


def _groups(values: dict[int, int]) -> list[list[int]]:
    by: dict[int, list[int]] = {}
    for r, v in sorted(values.items()):
        by.setdefault(v, []).append(r)
    return sorted(by.values())


MAX_NAMED = 10
"""Tensors named in a divergence message (all of them are in the evidence, up to 200)."""


def _state(base: str) -> bool:
    return base.endswith(".grad") or base.startswith("optimizer.")


def mechanism(diffs: list[dict[str, Any]], ddp: bool, compared: list[str] | None = None) -> str:
    """What the differing tensors say about how the replicas parted (checked at the step after the
    optimizer's, gradients still in place): gradients that differ were not reduced alike; equal
    gradients with differing parameters mean a rank-local change after the reduction. ``compared``:
    every tensor fingerprinted at that step; when no gradient or optimizer state is among them (a
    parameters-only check), nothing is claimed about the gradients."""
    bases = [split_group(d["tensor"])[0] for d in diffs]
    if compared is not None and not any(_state(split_group(n)[0]) for n in compared):
        return ("parameters or buffers differ; gradients and optimizer state were not fingerprinted at this "
                "step (they are at the first checks and every few after: --detector-option "
                "replica_divergence.state_every=1 tells whether the gradients parted first)")
    if any(b.endswith(".grad") for b in bases):
        if ddp:
            return ("gradients differ while a DDP wrapper exists: DDP reduced nothing for them (its hooks lost: "
                    "the model converted with .to()/.double()/.cuda() after wrapping, the forward run on the "
                    "unwrapped module, or a new wrapper built per step)")
        return "gradients differ: they were not reduced alike across the ranks before the update"
    if any(not b.startswith("optimizer.") for b in bases):
        return ("gradients were equal but parameters or buffers differ: a rank-local change after the gradient "
                "reduction (a bit flip, a rank-dependent update or buffer)")
    return "only optimizer state differs: a rank-local change to it (a restore, a rank-dependent update)"


def divergence_finding(step: int, diffs: list[dict[str, Any]], world: int, *, after_job: bool = False,
                       run_dir: str | None = None, ddp: bool = False, compared: list[str] | None = None) -> Finding:
    """The replica-divergence verdict, one rule and one wording for the online check (the ranks'
    exchange) and the check after the job (the snapshots on disk).

    A culprit is named "by majority" only when every differing tensor has a strict majority among
    at least 3 ranks of the group that must agree on it; otherwise every rank involved is listed and
    the message says there was no majority (two replicas that disagree cannot tell which is right).
    """
    culprits = sorted({r for d in diffs for r in d["ranks"]})
    named = ", ".join(d["tensor"] for d in diffs[:MAX_NAMED]) + (" ..." if len(diffs) > MAX_NAMED else "")
    sizes = {len(d["replica_group"]) if d.get("replica_group") else world for d in diffs}
    majority = all(d["by_majority"] for d in diffs) and min(sizes) >= 3
    groups = sorted({tuple(d["replica_group"]) for d in diffs if d.get("replica_group")})
    among = f" within replica group(s) {', '.join(str(list(g)) for g in groups)}" if groups else ""
    who = (f"rank(s) {culprits} differ from the majority{among}" if majority
           else f"ranks {culprits} disagree{among} (no majority with {min(sizes)} ranks)")
    found = " (found from the snapshots after the job)" if after_job else ""
    return Finding(
        severity=Severity.ERROR, detector="replica_divergence", ranks=culprits, step=step,
        subject=diffs[0]["tensor"],
        message=f"replicas diverged at step {step}{found}: {len(diffs)} tensor(s) differ ({named}); {who}; "
                f"{mechanism(diffs, ddp, compared)}",
        evidence={"tensors": diffs[:200], "count": len(diffs), "mechanism": mechanism(diffs, ddp, compared)},
        fix=f"first divergent step and tensor are above; 'distdebug diff {run_dir or 'RUN'} --step {step}' lists "
            "all of them. Usual causes: a rank-local update (unsynchronised gradients or buffers), silent data "
            "corruption, non-deterministic kernels",
    )
