"""``distdebug parity --html FILE``: the comparison on one self-contained page (issue 50), readable with scripts
off: the verdict and its likely causes, both runs' losses, and the loss's distance against its bound on a log
scale (the band: at the loss's own scale, rounding's band is too thin to see around a curve), drawn as inline
SVG from ``analysis.parity.Parity.series``. At most MAX_POINTS points a line: a longer run's steps are binned
(the largest distance of a bin kept: a departure is never averaged away)."""

from __future__ import annotations

import datetime
import html
import math
from pathlib import Path
from typing import Any

MAX_POINTS = 500
W, H, PAD = 760, 240, 48


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def binned(series: dict[int, float], keep: str = "last") -> list[tuple[int, float]]:
    """(step, value) points, at most MAX_POINTS: each bin's last value (a curve) or largest (a distance: ``max``);
    a value that is not finite stays in its bin (a NaN must stay visible)."""
    steps = sorted(series)
    size = max(1, math.ceil(len(steps) / MAX_POINTS))
    out = []
    for i in range(0, len(steps), size):
        chunk = steps[i:i + size]
        vals = [series[t] for t in chunk]
        bad = [v for v in vals if not math.isfinite(v)]
        if bad:
            out.append((chunk[0], bad[0]))
        elif keep == "max":
            j = max(range(len(vals)), key=vals.__getitem__)
            out.append((chunk[j], vals[j]))
        else:
            out.append((chunk[-1], vals[-1]))
    return out


def svg(lines: list[tuple[str, str, list[tuple[int, float]], bool]], log: bool = False,
        marks: list[tuple[int, str]] | None = None) -> str:
    """An inline SVG of ``lines`` ((label, colour, points, dashed)), steps across, values up (``log``: on a log
    scale, where a zero has no place: it is a circle on the axis, the line broken there, never a point at the
    smallest value drawn); a non-finite value is a cross at the top; ``marks``: (step, label) drawn as vertical
    lines."""
    finite = [v for _, _, pts, _ in lines for _, v in pts if math.isfinite(v) and (v > 0 or not log)]
    steps = [t for _, _, pts, _ in lines for t, _ in pts]
    if log and steps and not finite and all(v == 0 for _, _, pts, _ in lines for _, v in pts):
        return "<p>every value is 0: the runs agree bit for bit</p>"
    if not steps:
        return "<p>nothing to draw</p>"
    if not finite:  # zeros (log scale) or values that are not finite only: an axis of its own for the marks
        finite = [1e-12, 1.0] if log else [0.0, 1.0]
    lo, hi = min(finite), max(finite)
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    if hi == lo:
        lo, hi = lo - 1, hi + 1
    s0, s1 = min(steps), max(steps)
    span = max(s1 - s0, 1)

    def x(t: int) -> float:
        return PAD + (W - 2 * PAD) * (t - s0) / span

    def y(v: float) -> float:
        u = math.log10(v) if log else v
        return H - PAD + (2 * PAD - H) * (min(max(u, lo), hi) - lo) / (hi - lo)

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {W} {H}' width='{W}' height='{H}' "
             "role='img' style='background:#fff;border:1px solid #d6dae1'>"]
    parts.append(f"<line x1='{PAD}' y1='{H - PAD}' x2='{W - PAD}' y2='{H - PAD}' stroke='#888'/>"
                 f"<line x1='{PAD}' y1='{PAD}' x2='{PAD}' y2='{H - PAD}' stroke='#888'/>")
    top, bottom = (10 ** hi, 10 ** lo) if log else (hi, lo)
    parts.append(f"<text x='{PAD - 4}' y='{PAD + 4}' font-size='10' text-anchor='end'>{top:.3g}</text>"
                 f"<text x='{PAD - 4}' y='{H - PAD}' font-size='10' text-anchor='end'>{bottom:.3g}</text>"
                 f"<text x='{PAD}' y='{H - PAD + 14}' font-size='10'>step {s0}</text>"
                 f"<text x='{W - PAD}' y='{H - PAD + 14}' font-size='10' text-anchor='end'>step {s1}</text>")
    for i, (step, label) in enumerate(marks or []):  # labels one under the other: two marks may be close
        parts.append(f"<line x1='{x(step):.1f}' y1='{PAD}' x2='{x(step):.1f}' y2='{H - PAD}' stroke='#c81e1e' "
                     f"stroke-dasharray='3,3'/><text x='{x(step) + 3:.1f}' y='{PAD + 10 + 12 * i}' font-size='10' "
                     f"fill='#c81e1e'>{_e(label)}</text>")
    zeros_drawn = False
    for n, (label, colour, pts, dashed) in enumerate(lines):
        good = [(t, v) for t, v in pts if math.isfinite(v)]
        runs: list[list[tuple[int, float]]] = [[]]  # the line's pieces between the zeros (log scale)
        for t, v in good:
            if log and v <= 0:
                runs.append([])
                zeros_drawn = True
                parts.append(f"<circle cx='{x(t):.1f}' cy='{H - PAD}' r='3' fill='none' stroke='{colour}'>"
                             f"<title>{_e(label)}: 0 at step {t} (bit for bit)</title></circle>")
            else:
                runs[-1].append((t, v))
        dash = " stroke-dasharray='6,4'" if dashed else ""
        for piece in runs:
            if len(piece) == 1:
                (t, v), = piece
                parts.append(f"<circle cx='{x(t):.1f}' cy='{y(v):.1f}' r='1.5' fill='{colour}'>"
                             f"<title>{_e(label)}</title></circle>")
            elif piece:
                path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in piece)
                parts.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.5'{dash} points='{path}'>"
                             f"<title>{_e(label)}</title></polyline>")
        for t, v in pts:
            if not math.isfinite(v):
                parts.append(f"<text x='{x(t):.1f}' y='{PAD - 4}' font-size='12' fill='{colour}' "
                             f"text-anchor='middle'>\u00d7<title>{_e(label)}: {v} at step {t}</title></text>")
        # the legend above the plot, a line each (never over a curve)
        parts.append(f"<rect x='{PAD + 220 * n}' y='{PAD - 26}' width='10' height='3' fill='{colour}'/>"
                     f"<text x='{PAD + 14 + 220 * n}' y='{PAD - 22}' font-size='11'>{_e(label)}</text>")
    if zeros_drawn:
        parts.append(f"<text x='{W - PAD}' y='{H - PAD - 4}' font-size='10' text-anchor='end'>\u25cb on the axis: "
                     "0 (bit for bit)</text>")
    parts.append("</svg>")
    return "".join(parts)


def render_parity_html(result: Any, out: Path, ref: str = "", cand: str = "", twin: str = "") -> Path:
    """Write the page for ``result`` (``analysis.parity.Parity``) to ``out``; returns its path. ``ref``, ``cand``,
    ``twin``: the run directories compared, said at the top."""
    v = result.verdict
    s = result.series
    marks = []
    if v.first is not None:
        marks.append((v.first.step, f"departs: {v.first.quantity}"))
    if v.loss_departs is not None and (v.first is None or v.loss_departs != v.first.step):
        marks.append((v.loss_departs, "the loss departs"))
    losses = svg([("reference", "#1d4ed8", binned(s.get("ref", {})), False),
                  ("candidate", "#c2410c", binned(s.get("cand", {})), True)], marks=marks)
    band = svg([("|candidate - reference|", "#c2410c", binned(s.get("distance", {}), "max"), False),
                ("bound (slack x the twin's band)", "#047857", binned(s.get("bound", {}), "max"), True)],
               log=True, marks=marks)
    ok = v.equivalent
    causes = "".join(f"<li><b>{_e(c.kind)}</b> (step {c.step}): {_e(c.text)}</li>" for c in result.causes)
    rows = ""
    if v.first is not None or v.largest is not None:
        for what, d in (("first departure", v.first), ("largest observed/bound", v.largest)):
            if d is not None:
                rows += (f"<tr><td>{what}</td><td>{d.step}</td><td><code>{_e(d.quantity)}</code></td>"
                         f"<td class='num'>{d.observed:.3g}</td><td class='num'>{d.bound:.3g}</td>"
                         f"<td class='num'>{d.ratio:.3g}</td></tr>")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>distdebug parity</title>
<style>body{{font:14px/1.4 system-ui,sans-serif;margin:20px;color:#1d2330}}table{{border-collapse:collapse}}
td,th{{border:1px solid #d6dae1;padding:3px 8px}}td.num{{text-align:right}}.ok{{color:#047857}}.bad{{color:#c81e1e}}
pre{{white-space:pre-wrap}}</style></head><body>
<h1>distdebug parity: <span class="{'ok' if ok else 'bad'}">{'equivalent' if ok else 'departs'}</span></h1>
<p>reference {_e(ref)} ({result.ref_world} rank(s)), candidate {_e(cand)} ({result.cand_world} rank(s)), twin
{_e(twin)}; generated {datetime.datetime.now().isoformat(timespec="seconds")}</p>
<pre>{_e(result.text())}</pre>
{f"<h2>Likely causes, most direct first</h2><ul>{causes}</ul>" if causes else ""}
{f"<table><tr><th></th><th>step</th><th>quantity</th><th>observed</th><th>bound</th><th>ratio</th></tr>{rows}</table>"
 if rows else ""}
<h2>The loss, both runs</h2>{losses}
<h2>The loss's distance and its bound (log scale)</h2>
<p>Below the bound at every step: as close as the reference's own rounding allows (the twin's band, times the
slack). The red line: the first departure.</p>{band}
</body></html>
"""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out
