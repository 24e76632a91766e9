"""Tier 1 (pure): the report's host-cost model (analysis.costmodel, issue 62): the job's shape from discovery and
its accounting, the model's figure for it, and what the measured figure comes to at the job's step and at a step
ten times shorter."""

from __future__ import annotations

import pytest

from distdebug.analysis import costmodel
from distdebug.analysis.cost import per_rank

DISCOVERY = {"models": [{"class": "Sequential", "parameter_tensors": 1000, "modules": 1001}]}


def _rank(total_ms: float = 6.0, median_ms: float = 60.0) -> dict:
    c = per_rank({"steps": 100, "off_steps": 0, "backwards": 400, "training_thread_ms": {"session": total_ms * 100}},
                 median_ms)
    assert c is not None
    return c


def test_the_shape_comes_from_discovery_and_the_backward_calls_counted():
    r = _rank()
    assert r["backwards_per_step"] == 4.0
    assert costmodel.job_shape(DISCOVERY, r) == {"tensors": 1000.0, "modules": 1001.0, "forwards": 4.0}
    assert costmodel.job_shape({"models": [{"class": "M"}]}, r) is None  # an older run: no shape, no model line
    assert costmodel.job_shape(DISCOVERY, None) is None


def test_the_model_is_its_four_terms_and_the_share_is_said_at_the_step_and_a_tenth_of_it(monkeypatch):
    monkeypatch.setattr(costmodel, "MODEL", {"fixed_ms": 0.5, "per_tensor_us": 2.0, "per_forward_us": 100.0,
                                             "per_module_forward_us": 0.5})
    m = costmodel.assess(DISCOVERY, _rank(6.0, 60.0), None)
    assert m is not None
    # 0.5 + 2 us x 1,000 + 100 us x 4 + 0.5 us x 1,001 x 4 = 0.5 + 2 + 0.4 + 2.002
    assert m["model_ms"] == pytest.approx(4.902)
    assert (m["measured_ms"], m["how"], m["share"], m["share_at_tenth"]) == (6.0, "its own accounting", 0.1, 1.0)
    text = costmodel.describe(m)
    assert "0.50 ms + 2.0 us x 1,000 tensors + 100 us x 4 forwards a step + 0.50 us x 1,001 modules" in text
    assert "= 4.90 ms a step; this job measured 6.00 ms (its own accounting): 10.0% of its median step (60.00 ms)" \
        in text and "100.0% of a step 10 times shorter (6.00 ms" in text
    # the in-job A/B's figure against the steps without the harness is the one said when the run measured it
    m = costmodel.assess(DISCOVERY, _rank(6.0, 60.0), {"paid_ms": 7.5})
    assert m is not None and (m["measured_ms"], m["how"]) == (7.5, "in-job A/B against the steps without it")
