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


def one_off_text(r: dict[str, Any]) -> str:
    """What a rank paid once (analysis.cost): start-up, re-executions, profiler windows, and the whole run's
    figure with them spread over its steps."""
    parts = [f"start-up (step 1) {r.get('startup_ms', 0):.0f} ms"]
    parts += [f"{x['what']} {x['ms']:.0f} ms ({x['times']}x)" for x in r.get("one_off") or []]
    parts += [f"profiler window steps {w['steps']} {w['extra_ms']:.0f} ms above the median step"
              for w in r.get("profiler_windows") or []]
    whole = r.get("whole_run_per_step_ms")
    frac = r.get("whole_run_fraction")
    return ("paid once: " + ", ".join(parts)
            + (f"; with them, {whole:.3f} ms a step over the whole run" if whole is not None else "")
            + (f" ({frac:.1%})" if frac is not None else ""))
