"""Tier 1 (pure): each lint rule on a fixture with the pitfall (found, with its line) and on a clean
twin (nothing found)."""

from __future__ import annotations

import textwrap

import pytest

from distdebug.lint.static import lint_source

HEAD = """\
import torch
import torch.nn as nn
import deepspeed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
"""

CASES = {
    "ddp-find-unused-parameters": (
        "model = DDP(net, find_unused_parameters=True)",
        "model = DDP(net)"),
    "ddp-broadcast-buffers-batchnorm": (
        "net = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))\n"
        "model = DDP(net, broadcast_buffers=False)",
        "net = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))\n"
        "model = DDP(net)"),
    "ddp-output-device": (
        "model = DDP(net, output_device=0)",
        "model = DDP(net, device_ids=[0], output_device=0)"),
    "ddp-bucket-view-detach": (
        "model = DDP(net, gradient_as_bucket_view=True)\nfor p in model.parameters():\n    p.grad.detach_()",
        # In-place clipping after backward is fine with bucket views (the seed says otherwise).
        "model = DDP(net, gradient_as_bucket_view=True)\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"),
    "ddp-bucket-cap-mb": (
        "model = DDP(net, bucket_cap_mb=0.01)",
        "model = DDP(net, bucket_cap_mb=50)"),
    "ddp-static-graph-control-flow": (
        "class M(nn.Module):\n    def forward(self, x):\n        if x.sum() > 0:\n            return self.a(x)\n"
        "        return self.b(x)\nmodel = DDP(M(), static_graph=True)",
        "class M(nn.Module):\n    def forward(self, x):\n        if self.training:\n            return self.a(x)\n"
        "        return self.b(x)\nmodel = DDP(M(), static_graph=True)"),
    "compile-before-ddp": (
        "net = torch.compile(net)\nmodel = DDP(net)",
        "model = DDP(net)\nmodel = torch.compile(model)"),
    "batchnorm-not-synced": (
        "net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))\nmodel = DDP(net)",
        "net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))\n"
        "model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(net))"),
    "sampler-set-epoch": (
        "sampler = DistributedSampler(ds)\nfor epoch in range(3):\n"
        "    for b in DataLoader(ds, sampler=sampler):\n        pass",
        "sampler = DistributedSampler(ds)\nfor epoch in range(3):\n    sampler.set_epoch(epoch)\n"
        "    for b in DataLoader(ds, sampler=sampler):\n        pass"),
    "fsdp1-clip-grad-norm": (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\nmodel = FSDP(net)\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\nmodel = FSDP(net)\n"
        "model.clip_grad_norm_(1.0)"),
    "clip-rescaled-by-world-size": (
        "model = DDP(net)\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0 / world_size ** 0.5)",
        "model = DDP(net)\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"),
    "deepspeed-zero-grad-before-step": (
        "def train(batch):\n    engine, opt, _, _ = deepspeed.initialize(model=net, config=cfg)\n"
        "    loss = engine(batch)\n    engine.backward(loss)\n    engine.zero_grad()\n    engine.step()",
        "def train(batch):\n    engine, opt, _, _ = deepspeed.initialize(model=net, config=cfg)\n"
        "    loss = engine(batch)\n    engine.backward(loss)\n    engine.step()"),
    "deepspeed-torch-save": (
        "engine, opt, _, _ = deepspeed.initialize(model=net, config=cfg)\ntorch.save(engine.state_dict(), 'x.pt')",
        "engine, opt, _, _ = deepspeed.initialize(model=net, config=cfg)\nengine.save_checkpoint('ckpt', tag='s1')"),
    "deepspeed-offload-param-checkpointing": (
        "cfg = {'train_batch_size': 8, 'zero_optimization': {'stage': 3, 'offload_param': {'device': 'cpu'}},\n"
        "       'activation_checkpointing': {'partition_activations': True}}",
        "cfg = {'train_batch_size': 8, 'zero_optimization': {'stage': 3, 'offload_optimizer': {'device': 'cpu'}},\n"
        "       'activation_checkpointing': {'partition_activations': True}}"),
    "deepspeed-static-loss-scale": (
        "cfg = {'train_batch_size': 8, 'fp16': {'enabled': True, 'loss_scale': 128}}",
        "cfg = {'train_batch_size': 8, 'fp16': {'enabled': True, 'loss_scale': 0}}"),
    "deepspeed-batch-arithmetic": (
        "cfg = {'train_batch_size': 30, 'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 2}",
        "cfg = {'train_batch_size': 32, 'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 2}"),
}


LINE_HOLDS = {  # what the line a finding points at must show
    "ddp-find-unused-parameters": "find_unused_parameters", "ddp-broadcast-buffers-batchnorm": "broadcast_buffers",
    "ddp-output-device": "output_device", "ddp-bucket-view-detach": "detach_()", "ddp-bucket-cap-mb": "bucket_cap_mb",
    "ddp-static-graph-control-flow": "if x.sum()", "compile-before-ddp": "DDP(net)", "batchnorm-not-synced": "DDP(",
    "sampler-set-epoch": "DistributedSampler(ds)", "fsdp1-clip-grad-norm": "clip_grad_norm_",
    "clip-rescaled-by-world-size": "world_size", "deepspeed-zero-grad-before-step": "zero_grad",
    "deepspeed-torch-save": "torch.save", "deepspeed-offload-param-checkpointing": "cfg = {",
    "deepspeed-static-loss-scale": "loss_scale", "deepspeed-batch-arithmetic": "train_batch_size",
}


@pytest.mark.parametrize("rule", list(CASES))
def test_rule_finds_the_pitfall_with_its_line_and_not_the_clean_twin(rule):
    bad, good = CASES[rule]
    found = lint_source(HEAD + textwrap.dedent(bad))
    assert [f.rule for f in found] == [rule], found
    (f,) = found
    lines = (HEAD + textwrap.dedent(bad)).splitlines()
    assert LINE_HOLDS[rule] in lines[f.line - 1] and f.why and f.fix
    assert lint_source(HEAD + textwrap.dedent(good)) == []


def test_severity_of_the_deepspeed_zero_grad_follows_where_it_is():
    after = ("def train(batch):\n    engine, opt, _, _ = deepspeed.initialize(model=net, config=cfg)\n"
             "    engine.backward(engine(batch))\n    engine.step()\n    engine.zero_grad()")
    (f,) = lint_source(HEAD + after)
    assert (f.rule, f.severity) == ("deepspeed-zero-grad-redundant", "info")  # only redundant after step()
