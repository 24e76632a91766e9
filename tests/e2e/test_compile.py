"""Tier 3 (CLI): torch.compile in every placement, under DDP: the harness adds no recompilation and no
graph break (torch._dynamo's own counters, against the same script under torchrun), the training is
bitwise torchrun's, discovery sees the compiled model, and a NaN planted on rank 1 is placed there.

Needs: 2 ranks under DDP (compile's interplay with DDP's reducer is the subject) and 5 steps: the first
step compiles, later steps would recompile if the harness changed a guard, and the NaN planted at step
3 on rank 1 has steps before and after it."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_attach import kinds
from tests.helpers import DATA, distdebug, read_digests, torchrun

SCRIPT = str(DATA / "scripts" / "compiled.py")


def counters(out):
    c = json.loads((out / "rank0.json").read_text())
    return sum(c["graph_break"].values()), c["recompiles"], c["stats"].get("unique_graphs")


@pytest.mark.parametrize("place,extra", [
    ("outer", []), ("inner", []), ("method", []), ("blocks", []),
    ("inner", ["--backend", "inductor", "--fullgraph"]),
], ids=["compile(DDP(m))", "DDP(compile(m))", "m.compile()", "per-block", "inductor-fullgraph"])
def test_compiled_models_are_watched_without_a_recompilation(place, extra, tmp_path):
    args = ["--place", place, *extra, "--steps", "5", "--nan-at", "3", "--nan-rank", "1"]
    ref = torchrun(SCRIPT, *args, "--counters-out", str(tmp_path / "c_ref"), "--digest-out", str(tmp_path / "d_ref"),
                   timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    r = distdebug("attach", "--run-dir", str(tmp_path / "run"), SCRIPT, *args, "--counters-out", str(tmp_path / "c"),
                  "--digest-out", str(tmp_path / "d"), timeout=300)
    assert r.returncode == 0, r.output[-3000:]
    assert counters(tmp_path / "c") == counters(tmp_path / "c_ref")  # graph breaks, recompiles, graphs
    assert read_digests(tmp_path / "d") == read_digests(tmp_path / "d_ref")
    (disc,) = kinds(tmp_path / "run", 0, "discovery")
    assert len(disc["models"]) == 1
    errors = {rank: [(f["detector"], f["step"], f["ranks"]) for f in kinds(tmp_path / "run", rank, "finding")
                     if f["severity"] == "error" and f["detector"] == "nan_origin"] for rank in (0, 1)}
    assert errors == {0: [], 1: [("nan_origin", 3, [1])]}, errors
