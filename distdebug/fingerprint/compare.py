"""Comparing fingerprints across ranks: which tensors differ, and which ranks are the odd ones out."""

from __future__ import annotations

from collections import Counter
from typing import Any


def odd_ones_out(values: dict[int, int]) -> tuple[list[int], bool]:
    """Ranks whose value differs from a strict majority (and True), or all ranks (and False) if none."""
    counts = Counter(values.values())
    value, n = counts.most_common(1)[0]
    if len(values) >= 3 and n > len(values) / 2:
        return sorted(r for r, v in values.items() if v != value), True
    return sorted(values), False


def compare(per_rank: dict[int, dict[str, int]], order: list[str]) -> list[dict[str, Any]]:
    """Tensors whose fingerprints differ across ranks, in ``order``, with culprits by majority."""
    diffs = []
    names = order + sorted(set().union(*per_rank.values()) - set(order))
    for name in names:
        values = {r: fps[name] for r, fps in per_rank.items() if name in fps}
        missing = sorted(r for r, fps in per_rank.items() if name not in fps)
        if len(set(values.values())) > 1 or (missing and values):
            odd, by_majority = odd_ones_out(values) if len(set(values.values())) > 1 else (missing, True)
            diffs.append({"tensor": name, "ranks": odd, "by_majority": by_majority, "missing_on": missing,
                          "groups": _groups(values)})
    return diffs


def _groups(values: dict[int, int]) -> list[list[int]]:
    by: dict[int, list[int]] = {}
    for r, v in sorted(values.items()):
        by.setdefault(v, []).append(r)
    return sorted(by.values())
