"""DeepSpeed ZeRO-1 loop that zeroes gradients between engine.backward() and engine.step() from
--zero-grad-at on (the bug lint's deepspeed-zero-grad-before-step names), and extra zero_grad()
calls after step() (only redundant)."""

import argparse

import deepspeed
import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=4)
p.add_argument("--zero-grad-at", type=int, default=None)
p.add_argument("--train-batch-size", type=int, default=None, help="also set train_batch_size (wrong on purpose: "
               "DeepSpeed checks it against micro batch x accumulation x world size)")
args, _ = p.parse_known_args()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
if args.train_batch_size is not None:
    config["train_batch_size"] = args.train_batch_size
engine, _, _, _ = deepspeed.initialize(model=nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
                                       model_parameters=None, config=config)
g = torch.Generator().manual_seed(int(torch.distributed.get_rank()))  # each rank its own data
for step in range(1, args.steps + 1):
    x = torch.randn(4, 4, generator=g)
    engine.backward(engine(x).pow(2).mean())
    if args.zero_grad_at is not None and step >= args.zero_grad_at:
        engine.zero_grad()
    engine.step()
    engine.zero_grad()  # after step: redundant, not a bug
