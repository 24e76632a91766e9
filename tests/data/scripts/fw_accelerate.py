"""A Hugging Face accelerate script written the usual way (CPU, gloo, under torchrun): ``Accelerator`` with
``gradient_accumulation_steps=2``, ``prepare``, ``accumulate``, ``backward``, clipping by norm, an LR scheduler,
evaluation with ``gather_for_metrics``, and ``save_state`` / ``load_state`` mid-run. Final parameter digests.

accelerate is a test extra of distdebug, never a runtime dependency: tests skip this script where it is missing.
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from _disk import corrupt_safetensors  # noqa: E402

from recipes._common import base_parser, finish, param_digest, write_digest  # noqa: E402


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--save-at", type=int, default=6, help="optimizer step after which state is saved and loaded")
    p.add_argument("--corrupt-on-disk", action="store_true",
                   help="change one byte of one tensor in the saved model.safetensors before load_state")
    args = p.parse_args()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    train = DataLoader(TensorDataset(x[:1792], y[:1792]), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(TensorDataset(x[1792:], y[1792:]), batch_size=32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr / 10)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    model, opt, train, val, sched = acc.prepare(model, opt, train, val, sched)
    where = [tempfile.mkdtemp(prefix="fw_accelerate_") if acc.is_main_process else None]
    dist.broadcast_object_list(where)
    steps, loss, micro, losses = 0, torch.zeros(()), [], []
    while steps < args.steps:
        for xb, yb in train:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(xb), yb)
                acc.backward(loss)
                micro.append(float(loss.detach()))
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if acc.sync_gradients:
                steps += 1
                losses.append(sum(micro) / len(micro))  # the step's loss as the script computed it
                micro = []
                if steps == args.save_at:
                    acc.save_state(where[0])
                    acc.wait_for_everyone()
                    if args.corrupt_on_disk and acc.is_main_process:
                        changed = corrupt_safetensors(os.path.join(where[0], "model.safetensors"))
                        print(f"corrupted on disk: {changed}", flush=True)
                    acc.wait_for_everyone()
                    acc.load_state(where[0])
                if steps % 5 == 0:
                    model.eval()
                    correct = 0
                    with torch.no_grad():
                        for xv, yv in val:
                            pred = acc.gather_for_metrics(model(xv).argmax(-1))
                            correct += int((pred == acc.gather_for_metrics(yv)).sum())
                    model.train()
                if steps == args.steps:
                    break
    write_digest(args.digest_out, param_digest(acc.unwrap_model(model).named_parameters()), float(loss.detach()))
    if args.digest_out:
        with open(os.path.join(args.digest_out, f"losses{acc.process_index}.json"), "w") as f:
            json.dump(losses, f)
    acc.wait_for_everyone()
    if acc.is_main_process:
        import shutil

        shutil.rmtree(where[0], ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()
