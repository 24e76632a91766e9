"""Tier 2 (gloo, 2 ranks): the parity recorder's parts of a sharded tensor (distdebug/detectors/parity.py,
``_place`` and ``_sketch``): each rank sketches its local part of a DTensor at its global place, and the parts'
sketches sum to the whole tensor's sketch, for row shards (FSDP2's Shard(0), uneven), column shards (tensor
parallel's Shard(1)), a replicated DTensor (recorded once, by the first replica) and a ZeRO-3 partition (a block
of the flattened tensor, the last rank's padding left out: a stand-in with DeepSpeed's attributes, as
``partition_parameters`` lays them out). Its clean twin: a plain tensor is rank 0's whole; on a pipeline, each
rank of rank 0's pipeline records its own stage's."""

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
    # a ZeRO-3 parameter: 30 elements over 2 ranks in partitions of 15 (an odd 29 would pad the last by one)
    import torch.distributed as dist

    from distdebug.detectors.parity import _zero3_part

    for numel in (30, 29):
        flat = full.reshape(-1)[:numel]
        size = -(-numel // world)
        stand_in = torch.nn.Parameter(torch.empty(0))
        stand_in.ds_id, stand_in.ds_numel, stand_in.ds_process_group = 0, numel, None
        padded = torch.cat([flat, torch.full((size * world - numel,), 7.0)])
        stand_in.ds_tensor = padded[rank * size:(rank + 1) * size].clone()
        place = rec._place(f"zero3-{numel}", stand_in)
        out[f"zero3-{numel}"] = rec._sketch(_zero3_part(stand_in, place), place, 0).tolist()
        out[f"zero3-{numel}-whole"] = rec._sketch(flat.reshape(5, -1) if numel == 30 else flat, (), 0).tolist()
    # a pipeline: each rank its own stage (rank 0's pipeline: both ranks), so each records its plain tensors
    rec2 = ParityRecorder()
    rec2.ctx = RankContext(identity=RankIdentity.from_env(), run_dir=None, rank_dir=None)
    from distdebug.runtime.layout import Layout

    rec2.ctx.layout = Layout(rank=rank, world=world, stage={"index": rank, "stages": world, "ranks": [0, 1]})
    out["stage_plain"] = rec2._place("plain", full) is not None
    dist.barrier()
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
    # ZeRO-3 partitions at their offsets, the padding left out: their sum is the flattened whole's sketch
    for numel in (30, 29):
        total = sum(f64(r[f"zero3-{numel}"]) for r in got)
        assert torch.allclose(total, f64(got[0][f"zero3-{numel}-whole"]), rtol=0, atol=1e-9), numel
    assert [r["stage_plain"] for r in got] == [True, True]
