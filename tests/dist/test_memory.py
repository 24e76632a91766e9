"""Tier 2 (real gloo ranks, forked): the memory breakdown of a known model, against bytes computed by hand."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from distdebug.detectors.memory import Memory, optimizer_factor
from tests.dist.test_session import records, start_session
from tests.helpers import spawn_ranks


def _loop(rank, world, tmp, opt_name="adam"):
    s = start_session(tmp, rank, detectors=[Memory()])
    torch.manual_seed(0)
    model = nn.Linear(4, 8, bias=False)
    opt = (torch.optim.Adam(model.parameters(), lr=0.01) if opt_name == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.01))
    for _ in range(3):
        x = torch.randn(6, 4)
        model(x).pow(2).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


def test_breakdown_of_a_known_model_matches_the_bytes_by_hand(tmp_path):
    spawn_ranks(_loop, 2, tmp=tmp_path)
    for rank in (0, 1):
        mem = {r["step"]: r for r in records(tmp_path, rank, "memory")}
        # Parameters: 8x4 fp32 = 128 B. Gradients: the same. Adam: exp_avg + exp_avg_sq (128 B each)
        # and its 'step' counter (a 4-byte fp32 tensor). Activations: what backward needs, each
        # storage once and the weight left out: the input x (6x4 fp32 = 96 B) for the matmul's weight
        # gradient and the output (6x8 fp32 = 192 B) for pow's.
        assert {k: mem[2][k] for k in ("parameters", "gradients", "optimizer_state", "activations", "total")} == \
            {"parameters": 128, "gradients": 128, "optimizer_state": 260, "activations": 288, "total": 804}
        (peak,) = records(tmp_path, rank, "memory_peak")
        assert (peak["step"], peak["total"]) == (2, 804)


def test_static_estimate_factors_follow_the_optimizer():
    m = nn.Linear(2, 2)
    assert optimizer_factor(torch.optim.Adam(m.parameters())) == 2.0
    assert optimizer_factor(torch.optim.SGD(m.parameters(), lr=0.1)) == 0.0
    assert optimizer_factor(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) == 1.0
