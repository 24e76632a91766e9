"""Tier 2 (real gloo ranks, forked): under DDP a gradient-norm spike is named on the rank whose batch made it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from distdebug.detectors.loss_spike import LossSpike
from tests.dist.test_replica_divergence import findings
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks

STEPS, SPIKE = 30, 25


def _ddp(rank, world, tmp, bucket_view=False, spike_rank=1):
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = start_session(tmp, rank, detectors=[LossSpike()])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        if rank == spike_rank and step == SPIKE:
            y = y * 200  # one rank's corrupt targets: its loss and its own gradients jump
        nn.functional.mse_loss(ddp(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.1)  # the script clips: the spike is read before it
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


def _grad_norm_spikes(tmp, rank):
    return [(f["step"], f["ranks"]) for f in findings(tmp, rank)
            if f["detector"] == "loss_spike" and f["subject"] == "grad_norm"]


def test_a_gradient_norm_spike_is_named_on_the_rank_whose_batch_made_it(tmp_path):
    """DDP's default reduces copies: the norm at the end of the backward is the rank's own, so rank 1's corrupt
    batch at step 25 is a gradient-norm spike on rank 1 and none on rank 0 (both saw the same reduced, clipped
    gradients). With bucket views the reduction is inside the backward: every rank sees the reduced spike."""
    spawn_ranks(_ddp, 2, tmp=tmp_path / "default")
    assert _grad_norm_spikes(tmp_path / "default", 1)[:1] == [(SPIKE, [1])]
    assert all(step != SPIKE for step, _ in _grad_norm_spikes(tmp_path / "default", 0))
    spawn_ranks(_ddp, 2, tmp=tmp_path / "buckets", bucket_view=True)
    assert [_grad_norm_spikes(tmp_path / "buckets", r)[:1] for r in (0, 1)] == [[(SPIKE, [0])], [(SPIKE, [1])]]


def _scaled(rank, world, tmp):
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = start_session(tmp, rank, detectors=[LossSpike()])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=8)  # doubles every 8 clean steps
    scales = []
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        scaler.scale(nn.functional.mse_loss(ddp(x), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    dist.destroy_process_group()
    s.close(0)
    return scales


def test_a_loss_scalers_growth_is_no_gradient_norm_spike(tmp_path):
    """Healthy AMP: the gradients a backward leaves are scaled, and GradScaler doubles its scale every
    growth_interval clean steps; the norm is read with this step's scale divided out, so the doublings (3 in
    30 steps here) are no finding."""
    scales = spawn_ranks(_scaled, 2, tmp=tmp_path)
    assert scales[0][-1] == 2.0**13  # grew three times, and the run was clean
    assert [findings(tmp_path, r) for r in (0, 1)] == [[], []]
