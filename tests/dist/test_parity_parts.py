"""Tier 2 (gloo, 2 ranks): the parity recorder's parts of a sharded tensor (distdebug/detectors/parity.py,
``_place`` and ``_where``): each rank sketches its local part of a DTensor at its global place, and the parts' sketches sum to the
whole tensor's sketch, for row shards (FSDP2's Shard(0), uneven), column shards (tensor parallel's Shard(1)) and a
replicated DTensor (recorded once, by the first replica). Its clean twin: a plain tensor is rank 0's whole."""

from __future__ import annotations

import torch

from tests.helpers import spawn_ranks


def _parts(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from distdebug.context import RankContext, RankIdentity
    from distdebug.detectors.parity import ParityRecorder
    from distdebug.fingerprint.sketch import sketch

    rec = ParityRecorder()
    rec.ctx = RankContext(identity=RankIdentity.from_env(), run_dir=None, rank_dir=None)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    full = torch.randn(5, 6, generator=g)  # 5 rows over 2 ranks: uneven
    out = {"whole": sketch(full).tolist()}
    for name, placements in (("rows", [Shard(0)]), ("cols", [Shard(1)]), ("replicated", [Replicate()])):
        dt = distribute_tensor(full, mesh, placements)
        place = rec._place(name, dt)
        if place is None:
            out[name] = None
            continue
        out[name] = rec._sketch(dt.to_local(), place, 0).tolist()
    plain = rec._place("plain", full)
    out["plain"] = None if plain is None else rec._sketch(full, plain, 0).tolist()
    return out


def f64(values):
    """A sketch read back as float64 (a float32 tensor would round what is compared)."""
    return torch.tensor(values, dtype=torch.float64)


def test_a_sharded_tensors_parts_sum_to_the_whole_tensors_sketch():
    got = spawn_ranks(_parts, 2)
    whole = f64(got[0]["whole"])
    for name in ("rows", "cols"):
        total = sum(f64(r[name]) for r in got)
        assert torch.allclose(total, whole, rtol=0, atol=1e-9), name
        assert not torch.allclose(f64(got[0][name]), whole, atol=1e-3)  # one part is not the whole
    # a replicated DTensor and a plain tensor: recorded once, by the first replica / rank 0, whole
    assert got[1]["replicated"] is None and torch.allclose(f64(got[0]["replicated"]), whole, atol=1e-9)
    assert got[1]["plain"] is None and torch.allclose(f64(got[0]["plain"]), whole, atol=1e-9)
