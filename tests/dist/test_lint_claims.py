"""Tier 2 (real gloo ranks, forked): what PyTorch really does where the seed article is wrong, the
behaviour distdebug lint follows (SEED.md's marked claims)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers import spawn_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _clip_after_ddp(rank, world, bucket_view=False, detach=False):
    model = _model()
    ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))  # different data per rank
    ddp(x).pow(2).mean().backward()
    # The averaged gradient by hand: every rank's local gradient, gathered and averaged.
    local = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    if detach:
        try:
            next(model.parameters()).grad.detach_()
            return {"detach": "allowed"}
        except RuntimeError as e:
            return {"detach": str(e)[:120]}
    total = float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=0.01))  # in place, after backward
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt.step()
    return {"norm": total, "own_grad": local.tolist(), "same_grads": all(torch.equal(g, local) for g in gathered),
            "params": [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]}


def test_clip_grad_norm_after_ddp_sees_the_global_norm_without_rescaling():
    a, b = spawn_ranks(_clip_after_ddp, 2)
    # After DDP's all-reduce both ranks hold the same averaged gradient (different data per rank), so
    # the norm clip_grad_norm_ computes is the same everywhere: already global, no sqrt(world) needed.
    assert a["same_grads"] and b["same_grads"] and a["own_grad"] == b["own_grad"]
    assert a["norm"] == b["norm"] and a["norm"] > 0.01
    assert a["params"] == b["params"]  # clipped alike, stepped alike


def test_inplace_clipping_with_gradient_as_bucket_view_is_fine():
    plain = spawn_ranks(_clip_after_ddp, 2)
    views = spawn_ranks(_clip_after_ddp, 2, bucket_view=True)
    # Clipping the bucket views in place after backward gives exactly what plain gradients give.
    assert [r["params"] for r in views] == [r["params"] for r in plain]
    assert views[0]["norm"] == plain[0]["norm"]


def test_detach_on_bucket_view_gradients_is_what_pytorch_refuses():
    # The restriction PyTorch documents for gradient_as_bucket_view (lint's ddp-bucket-view-detach).
    views = spawn_ranks(_clip_after_ddp, 2, bucket_view=True, detach=True)
    assert all(r["detach"].startswith("Can't detach views in-place") for r in views)
    plain = spawn_ranks(_clip_after_ddp, 2, detach=True)
    assert all(r["detach"] == "allowed" for r in plain)


def _clip_under_fsdp1(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_model(), device_id=torch.device("cpu"))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    local = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9))  # no clipping: only the norm
    own = float(model.clip_grad_norm_(max_norm=1e9))
    return {"torch": local, "fsdp": own}


def test_clip_grad_norm_on_fsdp1_sees_only_the_local_shard():
    # The real trap behind the seed's clipping advice (lint's fsdp1-clip-grad-norm, config_lint at runtime):
    # under FSDP1 each rank holds a shard of the flat gradient, so torch's clip_grad_norm_ returns that
    # shard's norm, different on each rank; FSDP1's own returns the whole gradient's norm, the same
    # everywhere: the square root of the sum of the shards' squared norms.
    a, b = spawn_ranks(_clip_under_fsdp1, 2)
    assert a["torch"] != b["torch"]
    assert a["fsdp"] == b["fsdp"]
    assert abs(a["fsdp"] - (a["torch"] ** 2 + b["torch"] ** 2) ** 0.5) < 1e-5 * a["fsdp"]
    assert max(a["torch"], b["torch"]) < a["fsdp"]
