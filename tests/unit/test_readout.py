"""Tier 1 (pure): the step's one read gives back every value exactly, in its shape, in one tolist."""

from __future__ import annotations

import math

import pytest
import torch

from distdebug.runtime.readout import Readout


def test_values_come_back_exactly_in_their_shapes_with_one_read(monkeypatch):
    r = Readout()
    r.add("loss", torch.tensor(2.5, dtype=torch.float64))
    r.add("flag", torch.tensor(float("nan")))
    r.add("half", torch.tensor([1.5, -0.25], dtype=torch.bfloat16))
    r.add("rows", torch.tensor([[2**63 - 1, -(2**63)], [7, -1]], dtype=torch.int64))  # fingerprint sums
    r.add("count", torch.tensor(3, dtype=torch.int32))
    r.add("mask", torch.tensor([True, False]))
    reads = []
    original = torch.Tensor.tolist

    def counted(self):
        reads.append(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    out = r.read()
    assert len(reads) == 1  # everything in one transfer
    assert out["loss"] == 2.5 and math.isnan(out["flag"]) and out["half"] == [1.5, -0.25]
    assert out["rows"] == [[2**63 - 1, -(2**63)], [7, -1]] and out["count"] == 3 and out["mask"] == [1, 0]
    assert len(r) == 0 and r.read() == {}  # read once, then empty


def test_a_value_that_cannot_be_read_fails_when_added():
    r = Readout()
    with pytest.raises(TypeError):
        r.add("x", 1.0)
    with pytest.raises(TypeError):
        r.add("z", torch.tensor([1j]))
    assert len(r) == 0
