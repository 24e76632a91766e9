"""The harness's host cost as a model of the job's shape, said in every report (issue 62).

A GPU runs a step 10 to 100 times faster than a CPU while the harness's Python work on the training thread stays
what it is: what matters is that work in milliseconds, how it grows with the job, and what it comes to against a
step that is short. ``bench/host_cost.py`` measures it (the in-job A/B, every default detector on, fingerprints
every step, its off half without the harness's work) over 10 to 1,000 parameter tensors and 1 to 4 micro-batches
a step, and fits

    host ms a step = fixed + per tensor x tensors + per forward x forwards + per module a forward x modules x forwards

The report applies the fit to the job's own shape (its parameter tensors and modules from discovery, its forwards
a step from the backward calls it counted) beside what the job itself measured (the A/B's figure against a run
without distdebug when there is one, else the self-accounting), and says the measured figure as a share of the
job's median step and of a step ten times shorter (the same job on a device that is ten times faster). Pure.
"""

from __future__ import annotations

from typing import Any

MODEL = {"fixed_ms": 0.8, "per_tensor_us": 4.35, "per_forward_us": 188.0, "per_module_forward_us": 0.0}
"""The in-job A/B's fit of ``python bench/host_cost.py`` on the reference machine (MEASURED_ON; its per module a
forward came out at -0.09 us, within its residual of 0.18 ms: no module hook runs on the steady path, so 0);
docs/project/limits.md has the table it came from. A faster host pays less of each term."""
MEASURED_ON = "bench/host_cost.py, 2 ranks on a 2-core x86 VM, 2026-12-07 22:35"


def job_shape(discovery: dict[str, Any] | None, rank_cost: dict[str, Any] | None) -> dict[str, float] | None:
    """{tensors, modules, forwards}: the trained models' parameter tensors and modules (discovery) and the backward
    calls a step (the rank's accounting); None when the run does not say them (an older run)."""
    models = (discovery or {}).get("models") or []
    if not models or rank_cost is None or not rank_cost.get("backwards_per_step"):
        return None
    if any("parameter_tensors" not in m or "modules" not in m for m in models):
        return None
    return {"tensors": float(sum(m["parameter_tensors"] for m in models)),
            "modules": float(sum(m["modules"] for m in models)),
            "forwards": float(rank_cost["backwards_per_step"])}


def predict(shape: dict[str, float]) -> float:
    """The model's host ms a step for a job of this shape."""
    return (MODEL["fixed_ms"] + MODEL["per_tensor_us"] * shape["tensors"] / 1e3
            + MODEL["per_forward_us"] * shape["forwards"] / 1e3
            + MODEL["per_module_forward_us"] * shape["modules"] * shape["forwards"] / 1e3)


def assess(discovery: dict[str, Any] | None, rank_cost: dict[str, Any] | None,
           overhead: dict[str, Any] | None) -> dict[str, Any] | None:
    """The report's cost model: the job's shape, the model's figure for it, the figure this job measured (and
    how), and that figure's share of the median step and of a step ten times shorter."""
    shape = job_shape(discovery, rank_cost)
    if shape is None or rank_cost is None:
        return None
    if overhead and overhead.get("paid_ms") is not None:
        measured, how = float(overhead["paid_ms"]), "in-job A/B against the steps without it"
    else:
        measured, how = float(rank_cost["total_per_step_ms"]), "its own accounting"
    median = rank_cost.get("median_step_ms")
    out: dict[str, Any] = {**shape, "model": dict(MODEL), "measured_on": MEASURED_ON,
                           "model_ms": round(predict(shape), 3), "measured_ms": round(measured, 3), "how": how}
    if median:
        out.update(median_step_ms=round(median, 3), share=round(measured / median, 4),
                   share_at_tenth=round(10 * measured / median, 4))
    return out


def describe(m: dict[str, Any]) -> str:
    """``host cost model: 1.05 ms + 4.6 us x 1,000 tensors + ... = 6.5 ms a step; measured 6.2 ms ...``"""
    c = m["model"]
    text = (f"host cost model ({m['measured_on']}): {c['fixed_ms']:.2f} ms + {c['per_tensor_us']:.1f} us x "
            f"{m['tensors']:,.0f} tensors + {c['per_forward_us']:.0f} us x {m['forwards']:.3g} forward"
            f"{'' if m['forwards'] == 1 else 's'} a step")
    if c["per_module_forward_us"]:
        text += f" + {c['per_module_forward_us']:.2f} us x {m['modules']:,.0f} modules x forwards"
    text += f" = {m['model_ms']:.2f} ms a step; this job measured {m['measured_ms']:.2f} ms ({m['how']})"
    if "share" in m:
        text += (f": {m['share']:.1%} of its median step ({m['median_step_ms']:.2f} ms), {m['share_at_tenth']:.1%} "
                 f"of a step 10 times shorter ({m['median_step_ms'] / 10:.2f} ms, the same job on a faster device)")
    return text
