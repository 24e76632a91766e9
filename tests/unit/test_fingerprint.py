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
    fast_cpu_fingerprint,
    root_digest,
)
from distdebug.fingerprint.pending import fingerprints
from distdebug.fingerprint.snapshots import SnapshotWriter, read_snapshots

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8]


def flip(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    u = t.clone()
    u.reshape(-1).view(torch.uint8)[byte] ^= 1 << bit
    return u


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_single_bit_flip_changes_every_fingerprint(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(37, generator=g) * 100).to(dtype)
    base_cpu, base_dev, base_fast = cpu_fingerprint(t), device_fingerprint(t).tolist(), fast_cpu_fingerprint(t)
    nbytes = t.numel() * t.element_size()
    for byte in range(0, nbytes, max(1, nbytes // 23)):
        for bit in (0, 3, 7):
            u = flip(t, byte, bit)
            assert cpu_fingerprint(u) != base_cpu
            assert device_fingerprint(u).tolist() != base_dev
            assert fast_cpu_fingerprint(u) != base_fast


def test_the_fast_cpu_fingerprint_is_xxh3_of_the_bytes_in_its_own_value_space():
    # Cross-rank comparisons of CPU tensors (every rank holds them on the CPU) take xxh3 over the bytes,
    # at a read pass's speed (bench/fingerprint_throughput.py); checkpoints keep the portable one.
    t = torch.arange(12.0).view(3, 4)
    assert fast_cpu_fingerprint(t) == fast_cpu_fingerprint(t.clone()) != cpu_fingerprint(t)
    nc = t.t()
    assert fast_cpu_fingerprint(nc) == fast_cpu_fingerprint(nc.contiguous()) != fast_cpu_fingerprint(t)
    assert fast_cpu_fingerprint(t) != fast_cpu_fingerprint(t.view(torch.int32))  # dtype and shape seed it
    assert fast_cpu_fingerprint(t) != fast_cpu_fingerprint(t.view(4, 3))
    assert fast_cpu_fingerprint(torch.empty(0)) == fast_cpu_fingerprint(torch.empty(0))
    swapped = torch.tensor([2.0, 1.0, 3.0]), torch.tensor([1.0, 2.0, 3.0])
    assert fast_cpu_fingerprint(swapped[0]) != fast_cpu_fingerprint(swapped[1])
    named = [("t", t)]
    assert fingerprints(named) == {"t": fast_cpu_fingerprint(t)}
    assert fingerprints(named, portable=True) == {"t": cpu_fingerprint(t)}


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


def test_large_tensors_hash_in_blocks_deterministically(monkeypatch):
    from distdebug.fingerprint import hashing

    monkeypatch.setattr(hashing, "BLOCK", 1000)
    monkeypatch.setattr(hashing, "GROUP", 300)
    big = torch.randn(3 * 1000 + 5)  # several blocks and a ragged tail
    named = [("small", torch.ones(3)), ("big", big), ("tail", torch.zeros(2))]
    fps = fingerprints(named, portable=True)
    assert list(fps) == ["small", "big", "tail"]  # the caller's order
    assert fps["big"] == cpu_fingerprint(big) == cpu_fingerprint(big.clone())
    assert cpu_fingerprint(flip(big, 4 * 1000 + 7, 1)) != fps["big"]  # a bit in the second block


def _host(rows):
    return [tuple(int(x) & (2**64 - 1) for x in r) for r in rows.tolist()]


ALL_DTYPES = DTYPES + [torch.int8, torch.int16, torch.bool, torch.complex64, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_device_path_and_cpu_path_give_the_same_fingerprint(dtype, monkeypatch):
    # One definition, two implementations: a tensor on a GPU and its copy on the CPU (a checkpoint
    # loaded with map_location, an offloaded shard) must fingerprint alike. Small blocks and groups so
    # that both the fused path and the blocked path, and their edges, are crossed.
    from distdebug.fingerprint import hashing

    monkeypatch.setattr(hashing, "BLOCK", 256)
    monkeypatch.setattr(hashing, "GROUP", 100)
    g = torch.Generator().manual_seed(1)
    tensors = []
    for n in (0, 1, 2, 3, 5, 99, 100, 101, 257, 1023, 1500):
        x = torch.randn(n, generator=g) * 50
        tensors.append(x.to(dtype) if not dtype.is_complex else torch.randn(n, dtype=dtype, generator=g))
    flat = torch.randn(700, generator=g).to(dtype) if not dtype.is_complex else torch.randn(700, dtype=dtype)
    tensors += [flat[1:300], flat[3:650], flat.view(-1)[5:6], torch.randn(7, 9, generator=g).to(dtype).t()]
    cpu = hashing.cpu_sums_many(tensors)
    assert cpu == _host(hashing.device_sums(tensors))
    assert cpu == [hashing.cpu_sums(t) for t in tensors] == [_host(hashing.device_fingerprint(t)[None])[0]
                                                            for t in tensors]
    monkeypatch.setenv("DISTDEBUG_DEVICE_PATH", "1")
    forced = fingerprints([(str(i), t) for i, t in enumerate(tensors)])
    monkeypatch.delenv("DISTDEBUG_DEVICE_PATH")
    assert forced == fingerprints([(str(i), t) for i, t in enumerate(tensors)], portable=True)


def test_words_trading_places_are_caught_anywhere(monkeypatch):
    # The old weights (column+1)*(row+1) gave positions (0,1) and (1,0) the same weight. Linear
    # weights cannot collide: (w_i - w_j)(j - i) is never 0 modulo 2^64.
    from distdebug.fingerprint import hashing

    monkeypatch.setattr(hashing, "BLOCK", 64)
    t = torch.arange(1, 300, dtype=torch.int32)
    base = hashing.cpu_sums(t)
    for i, j in ((0, 1), (1, 64), (0, 65), (63, 64), (10, 298), (128, 129)):
        u = t.clone()
        u[i], u[j] = t[j], t[i]
        assert hashing.cpu_sums(u)[0] == base[0] and hashing.cpu_sums(u)[1] != base[1], (i, j)
        assert _host(hashing.device_sums([u])) == [hashing.cpu_sums(u)]


class _Kernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that make new memory (kernels, not views) and the largest output's bytes."""

    def __init__(self):
        super().__init__()
        self.kernels, self.largest = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                self.kernels += 1
                self.largest = max(self.largest, o.untyped_storage().nbytes())
        return out


def test_device_path_costs_a_constant_number_of_kernels_and_bounded_temporaries(monkeypatch):
    from distdebug.fingerprint import hashing

    counts = []
    for n in (10, 200):  # a group of 10 small tensors, one of 200 (odd sizes: padded)
        ts = [torch.randn(3 + i % 5).to(torch.bfloat16) for i in range(n)]
        hashing.device_sums(ts)  # layouts and index cached, as at every step after the first
        with _Kernels() as k:
            hashing.device_sums(ts)
        counts.append(k.kernels)
    assert counts[0] == counts[1] <= 24, counts  # the same for 10 tensors as for 200
    monkeypatch.setattr(hashing, "BLOCK", 1 << 12)
    monkeypatch.setattr(hashing, "GROUP", 1 << 10)
    big = torch.randn(40 << 12)  # 40 blocks
    hashing.device_sums([big])
    with _Kernels() as k:
        hashing.device_sums([big])
    assert k.largest <= 8 * (1 << 12), k.largest  # one int64 block, never a copy of the tensor
    assert k.kernels <= 6 * 40 + 8


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
        assert cpu_fingerprint(odd) == combine_device(device_fingerprint(odd).tolist(), odd)


def test_the_divergence_says_how_the_replicas_parted():
    from distdebug.fingerprint.compare import mechanism

    grads = [{"tensor": "w.grad"}, {"tensor": "w"}]
    assert mechanism(grads, ddp=True).startswith("gradients differ while a DDP wrapper exists: DDP reduced nothing")
    assert mechanism(grads, ddp=False).startswith("gradients differ: they were not reduced alike")
    assert mechanism([{"tensor": "w"}, {"tensor": "optimizer.w.exp_avg"}], ddp=True).startswith(
        "gradients were equal but parameters")
    assert mechanism([{"tensor": "w.grad@replicas[0,2]"}], ddp=False).startswith("gradients differ")
    assert mechanism([{"tensor": "optimizer.w.momentum_buffer"}], ddp=True).startswith("only optimizer state")
    # A parameters-only check (issue 18: gradients and optimizer state every few checks) claims nothing about
    # the gradients; a full one at the same divergence does.
    only_params = mechanism([{"tensor": "w"}], ddp=True, compared=["w", "b", "bn.running_mean"])
    assert only_params.startswith("parameters or buffers differ; gradients and optimizer state were not "
                                  "fingerprinted at this step") and "state_every=1" in only_params
    assert mechanism([{"tensor": "w"}], ddp=True, compared=["w", "w.grad@replicas[0,1]"]).startswith(
        "gradients were equal but parameters")


def test_gradients_and_optimizer_state_are_checked_first_and_then_every_few_checks():
    from distdebug.config import ReplicaDivergenceConfig
    from distdebug.errors import UserError

    every = ReplicaDivergenceConfig()
    assert [s for s in range(1, 41) if every.state_checked(s)] == [*range(1, 9), 16, 24, 32, 40]
    third = ReplicaDivergenceConfig(every=3, state_every=2)  # steps 3, 6, 9, ... are checked
    assert [s for s in range(3, 40, 3) if third.state_checked(s)] == [3, 6, 12, 18, 24, 30, 36]
    assert all(ReplicaDivergenceConfig(state_every=1).state_checked(s) for s in range(1, 50))
    with pytest.raises(UserError, match="state_every must be 1 or more"):
        ReplicaDivergenceConfig(state_every=0)
