"""Tier 1 (pure): fingerprints change with any bit, cover every dtype and layout; majority and compare logic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distdebug.artifacts import layout
from distdebug.fingerprint.compare import compare, odd_ones_out, split_group, with_group
from distdebug.fingerprint.hashing import (
    combine_device,
    cpu_fingerprint,
    device_fingerprint,
    fingerprints,
    root_digest,
)
from distdebug.fingerprint.snapshots import SnapshotWriter, read_snapshots

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8]


def flip(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    u = t.clone()
    u.reshape(-1).view(torch.uint8)[byte] ^= 1 << bit
    return u


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_single_bit_flip_changes_both_fingerprints(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(37, generator=g) * 100).to(dtype)
    base_cpu, base_dev = cpu_fingerprint(t), device_fingerprint(t).tolist()
    nbytes = t.numel() * t.element_size()
    for byte in range(0, nbytes, max(1, nbytes // 23)):
        for bit in (0, 3, 7):
            u = flip(t, byte, bit)
            assert cpu_fingerprint(u) != base_cpu
            assert device_fingerprint(u).tolist() != base_dev


def test_equal_tensors_equal_fingerprints_and_layouts():
    t = torch.arange(12.0).view(3, 4)
    assert cpu_fingerprint(t) == cpu_fingerprint(t.clone())
    nc = t.t()  # non-contiguous: fingerprinted as its contiguous bytes, with its own shape
    assert not nc.is_contiguous()
    assert cpu_fingerprint(nc) == cpu_fingerprint(nc.contiguous())
    assert cpu_fingerprint(nc) != cpu_fingerprint(t)
    # same bytes, other dtype or shape: different fingerprint
    assert cpu_fingerprint(t) != cpu_fingerprint(t.view(torch.int32))
    assert cpu_fingerprint(t) != cpu_fingerprint(t.view(4, 3))
    assert cpu_fingerprint(torch.empty(0)) == cpu_fingerprint(torch.empty(0))
    assert cpu_fingerprint(torch.tensor(True)) != cpu_fingerprint(torch.tensor(False))


def test_device_fingerprint_catches_swapped_words():
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    swapped = torch.tensor([2.0, 1.0, 3.0, 4.0])
    a, b = device_fingerprint(t), device_fingerprint(swapped)
    assert a[0] == b[0] and a[1] != b[1]  # the plain sum is blind to the swap; the weighted one is not
    assert combine_device(a.tolist(), t) != combine_device(b.tolist(), swapped)


def test_fingerprints_and_root_digest():
    named = [("a", torch.ones(3)), ("b", torch.zeros(2))]
    fps = fingerprints(named)
    assert set(fps) == {"a", "b"} and root_digest(fps) == root_digest(dict(fps))
    assert root_digest(fps) != root_digest({**fps, "b": fps["b"] ^ 1})
    assert root_digest(fps) != root_digest({"a": fps["a"], "c": fps["b"]})  # names count too


def test_majority_and_two_rank_rules():
    assert odd_ones_out({0: 5, 1: 5, 2: 9}) == ([2], True)
    assert odd_ones_out({0: 5, 1: 9}) == ([0, 1], False)  # two ranks: both named, no guess
    assert odd_ones_out({0: 1, 1: 2, 2: 3}) == ([0, 1, 2], False)
    diffs = compare({0: {"w": 1, "b": 2}, 1: {"w": 1, "b": 2}, 2: {"w": 7, "b": 2}}, ["w", "b"])
    assert diffs == [{"tensor": "w", "ranks": [2], "by_majority": True, "missing_on": [], "groups": [[0, 1], [2]],
                      "replica_group": None}]


def test_replica_groups_are_compared_within_the_group_only():
    # HSDP on 4 ranks, replicate groups {0,2} and {1,3}: each group holds its own shard of "w".
    a, b = "w@replicas[0,2]", "w@replicas[1,3]"
    assert split_group(a) == ("w", [0, 2]) and split_group("w") == ("w", None) and with_group("w", [1, 3]) == b
    per_rank = {0: {a: 10, "buf": 1}, 1: {b: 20, "buf": 1}, 2: {a: 10, "buf": 1}, 3: {b: 20, "buf": 1}}
    assert compare(per_rank, [a, "buf"]) == []  # different shards in different groups: by design
    per_rank[3] = {b: 21, "buf": 1}
    (d,) = compare(per_rank, [a, "buf"])
    assert (d["tensor"], d["ranks"], d["replica_group"], d["groups"]) == ("w", [1, 3], [1, 3], [[1], [3]])
    per_rank[3] = {"buf": 1}  # a group member that lacks the tensor
    (d,) = compare(per_rank, [a, "buf"])
    assert (d["tensor"], d["ranks"], d["missing_on"]) == ("w", [3], [3])


def test_offline_diff_respects_replica_groups(tmp_path):
    from distdebug.analysis.diff import diff_step, first_divergent_step, load_snapshots

    a, b = "w@replicas[0,2]", "w@replicas[1,3]"
    values = {0: {a: 10}, 1: {b: 20}, 2: {a: 10}, 3: {b: 20}}
    for rank, fps in values.items():
        w = SnapshotWriter(layout.rank_dir(tmp_path, rank))
        w.write(1, fps)
        w.write(2, {n: v + (1 if rank == 2 else 0) for n, v in fps.items()})
        w.close()
    snaps = load_snapshots(tmp_path)
    assert diff_step(snaps, 1) == []
    step, (d,) = first_divergent_step(snaps)
    assert (step, d.tensor, d.ranks, d.replica_group) == (2, "w", [0, 2], [0, 2])


def test_snapshot_round_trip_and_cut_record(tmp_path):
    w = SnapshotWriter(tmp_path)
    w.write(1, {"a": 1, "b": 2**64 - 1})
    w.write(2, {"a": 3, "b": 4})
    w.write(3, {"a": 5, "c": 6})
    w.close()
    with open(tmp_path / "fingerprints.bin", "ab") as f:
        f.write(b"\x04\x00")  # a record cut short by a kill
    snaps = read_snapshots(tmp_path)
    assert sorted(snaps) == [1, 2, 3]
    names, values = snaps[1]
    assert names == ["a", "b"] and values.dtype == np.uint64 and int(values[1]) == 2**64 - 1
    assert snaps[3][0] == ["a", "c"]


def test_large_tensors_hash_in_parallel_chunks_deterministically():
    from distdebug.fingerprint import hashing

    big = torch.randn(3 * hashing.CHUNK // 4 + 5)  # several chunks and a ragged tail
    named = [("small", torch.ones(3)), ("big", big), ("tail", torch.zeros(2))]
    fps = fingerprints(named)
    assert list(fps) == ["small", "big", "tail"]  # the caller's order
    assert fps["big"] == cpu_fingerprint(big) == cpu_fingerprint(big.clone())
    assert cpu_fingerprint(flip(big, hashing.CHUNK + 7, 1)) != fps["big"]  # a bit in the second chunk


def test_hashing_leaves_storages_resizable():
    # FSDP2 frees gathered parameters with storage.resize_(0); Tensor.numpy() would forbid that for good.
    t = torch.randn(300)
    before = fingerprints([("t", t)])
    t.untyped_storage().resize_(0)
    assert before["t"] != 0


def test_device_path_takes_two_byte_tensors_at_odd_offsets():
    # A bf16/fp16 slice at an odd element offset (ZeRO's flat buffers, DDP's bucket views): its bytes
    # cannot be viewed as 32-bit words in place. The device path (run here on CPU tensors) must still
    # fingerprint it, the same as the same values at an aligned offset.
    from distdebug.fingerprint.hashing import device_fingerprint

    for dtype in (torch.bfloat16, torch.float16):
        buf = torch.arange(6, dtype=dtype)
        odd = buf[1:5]
        assert odd.storage_offset() == 1
        assert device_fingerprint(odd).tolist() == device_fingerprint(odd.clone()).tolist()
        assert device_fingerprint(buf[1:3]).tolist() != device_fingerprint(buf[2:4]).tolist()
