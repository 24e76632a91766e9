"""Plain-text formatting shared by the terminal and HTML reports (no rich, no HTML here)."""

from __future__ import annotations

import math
from typing import Any


def number(x: float | None, digits: int = 4) -> str:
    """``-`` for nothing, ``nan``/``inf`` as they are, else ``digits`` significant digits."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


def rank_list(ranks: list[int]) -> str:
    """``0,1,3``; beyond 8 ranks ``first..last (count)``; ``-`` for none."""
    if len(ranks) > 8:
        return f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
    return ",".join(str(r) for r in ranks) or "-"


def memory_mb(peak: dict | None) -> str:
    """A rank's peak: parameters / gradients / optimizer state / activations in MB (+ other GPU memory), step."""
    if not peak:
        return "-"
    mb = [(peak.get(k) or 0) / 2**20 for k in ("parameters", "gradients", "optimizer_state", "activations")]
    text = " / ".join(f"{v:.3g}" for v in mb)
    if peak.get("other") is not None:
        text += f" + other {peak['other'] / 2**20:.3g}"
    return f"{text} (step {peak.get('step')})"


def format_finding(f: Any) -> str:
    """A finding as the launcher prints it on stderr: one line, and its fix on a second."""
    step = f" step {f.step}" if f.step is not None else ""
    ranks = f" rank(s) {','.join(map(str, f.ranks))}" if f.ranks else ""
    text = f"distdebug: {f.severity.value.upper()} {f.detector}{ranks}{step}: {f.subject}: {f.message}"
    return text + (f"\ndistdebug:   fix: {f.fix}" if f.fix else "")
