"""Tier 1 (pure): the step's one read gives back every value exactly, in its shape, in one tolist."""

from __future__ import annotations

import math

import pytest
import torch

from distdebug.runtime.readout import Readout


def _count_reads(monkeypatch) -> list:
    """The dtype of every tensor read to the host with ``tolist`` from now on (the readout's one read)."""
    reads: list = []
    original = torch.Tensor.tolist

    def counted(self):
        reads.append(self.dtype)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return reads


def test_values_come_back_exactly_in_their_shapes_with_one_read(monkeypatch):
    r = Readout()
    r.add("loss", torch.tensor(2.5, dtype=torch.float64))
    r.add("flag", torch.tensor(float("nan")))
    r.add("half", torch.tensor([1.5, -0.25], dtype=torch.bfloat16))
    r.add("rows", torch.tensor([[2**63 - 1, -(2**63)], [7, -1]], dtype=torch.int64))  # fingerprint sums
    r.add("count", torch.tensor(3, dtype=torch.int32))
    r.add("mask", torch.tensor([True, False]))
    reads = _count_reads(monkeypatch)
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


def test_many_values_of_every_kind_are_packed_in_a_few_ops_whatever_their_number():
    """Issue 62: a value used to cost five dispatched ops (a launch each on a GPU); the read packs them all."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    r = Readout()
    expected = {}
    for k in range(40):  # interleaved kinds, shapes and dtypes
        kind = k % 5
        if kind == 0:
            v = torch.tensor(k + 0.5, dtype=torch.float32)
            expected[k] = k + 0.5
        elif kind == 1:
            v = torch.tensor([k, -k, 2**62 + k], dtype=torch.int64)
            expected[k] = [k, -k, 2**62 + k]
        elif kind == 2:
            v = torch.tensor([[k * 0.25, 1e300], [-0.0, float("inf")]], dtype=torch.float64)
            expected[k] = [[k * 0.25, 1e300], [-0.0, float("inf")]]
        elif kind == 3:
            v = torch.tensor(k % 2 == 0)
            expected[k] = int(k % 2 == 0)
        else:
            v = torch.tensor([k * 0.5, -1.5], dtype=torch.bfloat16)
            expected[k] = [k * 0.5, -1.5]
        r.add(k, v)
    with Count():
        out = r.read()
    assert out == expected
    launches = [op for op in Count.ops if "view" not in op]  # a view of a 2-d value launches nothing on a GPU
    # views: one a 2-d value (8 here) and the float words seen as int64
    assert len(launches) <= 8 and len(Count.ops) - len(launches) <= 8 + 1, Count.ops  # not 5 a value (200)


def test_a_sparse_or_meta_value_fails_when_added_and_the_others_still_read():
    r = Readout()
    r.add("ok", torch.tensor(1.25))
    with pytest.raises(TypeError):
        r.add("sparse", torch.eye(2).to_sparse())
    with pytest.raises(TypeError):
        r.add("meta", torch.empty(2, device="meta"))
    assert r.read() == {"ok": 1.25}


def test_a_list_of_values_under_one_key_comes_back_in_order_in_the_same_one_read(monkeypatch):
    """Issue 62: a detector hands its flags over as they are (``add_many``, a probe's list) and judges them on the
    host; they are packed with every other value, and a step whose values are all floats or all integers is read
    with no conversion of its own."""
    r = Readout()
    r.add("loss", torch.tensor(0.5, dtype=torch.float64))
    r.add_many("flags", [torch.tensor(1.0), torch.tensor([float("nan"), 2.0]), torch.tensor(3.0, dtype=torch.bfloat16)])
    r.add_many("empty", [])
    r.add_many("flags", [torch.tensor(4.0)])  # a second list under the same key follows the first
    reads = _count_reads(monkeypatch)
    out = r.read()
    assert reads == [torch.float64]  # one read, of the floats as they are
    assert out["loss"] == 0.5 and out["empty"] == []
    assert out["flags"][0] == 1.0 and math.isnan(out["flags"][1][0]) and out["flags"][1][1] == 2.0
    assert out["flags"][2:] == [3.0, 4.0]
    with pytest.raises(TypeError):
        r.add_many("bad", [torch.tensor(1.0), 2.0])  # one bad value refuses the whole list
    with pytest.raises(TypeError):
        r.add_many("bad", torch.tensor([1.0]))
    assert len(r) == 0
    r.add("n", torch.tensor(7))
    assert r.read() == {"n": 7} and reads[-1] == torch.int64


def test_the_host_judges_a_detectors_flags_as_the_device_max_did():
    """nan_origin's flags are judged on the host now (flags.all_finite); it must say what the max of them said."""
    from distdebug.detectors.nan_origin.flags import all_finite

    assert all_finite([]) and all_finite([0.0, [1e308, [2.0]], 3])
    for bad in (math.nan, math.inf, -math.inf):
        assert not all_finite([0.0, [1.0, [2.0, bad]]]) and not all_finite([bad])
