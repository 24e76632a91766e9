"""DeepSpeed ZeRO-1 loop that zeroes gradients between engine.backward() and engine.step() from
--zero-grad-at on (the bug lint's deepspeed-zero-grad-before-step names), and extra zero_grad()
calls after step() (only redundant)."""

import argparse
import os
import sys

import deepspeed
import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=4)
p.add_argument("--zero-grad-at", type=int, default=None)
p.add_argument("--train-batch-size", type=int, default=None, help="also set train_batch_size (wrong on purpose: "
               "DeepSpeed checks it against micro batch x accumulation x world size)")
p.add_argument("--torch-save", default=None, help="torch.save(engine.module.state_dict(), PATH) after step 2")
p.add_argument("--save-checkpoint", default=None, help="engine.save_checkpoint(DIR) after step 2 (the right way)")
p.add_argument("--zero-stage", type=int, default=1)
p.add_argument("--offload-param", action="store_true", help="ZeRO-3 offload_param to cpu, with activation "
               "checkpointing (partition_activations) in the config")
p.add_argument("--fp16-loss-scale", type=float, default=None, help="fp16 with this loss scale (0: dynamic)")
args, _ = p.parse_known_args()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
config["zero_optimization"]["stage"] = 3 if args.offload_param else args.zero_stage
if args.offload_param:
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    config["activation_checkpointing"] = {"partition_activations": True}
if args.fp16_loss_scale is not None:
    config["fp16"] = {"enabled": True, "loss_scale": args.fp16_loss_scale}
if args.train_batch_size is not None:
    config["train_batch_size"] = args.train_batch_size
engine, _, _, _ = deepspeed.initialize(model=nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
                                       model_parameters=None, config=config)
g = torch.Generator().manual_seed(int(torch.distributed.get_rank()))  # each rank its own data
for step in range(1, args.steps + 1):
    x = torch.randn(4, 4, generator=g)
    if args.fp16_loss_scale is not None:
        x = x.half()
    engine.backward(engine(x).float().pow(2).mean())
    if args.zero_grad_at is not None and step >= args.zero_grad_at:
        engine.zero_grad()
    engine.step()
    engine.zero_grad()  # after step: redundant, not a bug
    if step == 2 and args.torch_save:
        torch.save(engine.module.state_dict(), args.torch_save)
    if step == 2 and args.save_checkpoint:
        engine.save_checkpoint(args.save_checkpoint, tag="step2")
torch.distributed.destroy_process_group()
# DeepSpeed's objects still hold its groups (and their gloo threads) past destroy_process_group();
# leaving without interpreter teardown avoids torch's teardown abort (see recipes/_common.finish).
sys.stdout.flush()
os._exit(0)
