"""Loss and gradient-norm traces of real training scripts over many seeds (issue 38: loss_spike judged on
what a spike is for a run's own history, proven both ways on real curves, not on a formula's).

    python bench/loss_traces.py                      # writes tests/data/loss_curves/traces.json
    python bench/loss_traces.py --seeds 20 --steps 60
    python bench/loss_traces.py --scripts resnet_fast  # records that family only; the file keeps the others

Scripts of different kinds, each run in one process per seed (the rule is per rank: one rank's curve is
what it judges), recording per optimizer step what loss_spike reads: the loss (the mean of the step's
micro-batches) and the L2 norm of the gradients when the step's last backward ends, before clipping:

- resnet: a small residual CNN with BatchNorm on synthetic teacher-labelled images, SGD with momentum 0.9
  and lr 0.1 (the early bumps of such a script are what loss_spike must not call spikes);
- gpt: recipes/gpt_ddp.py's model (4 blocks), AdamW, a warm-up then a cosine schedule, gradient
  accumulation 2, clipping at 1.0, on synthetic tokens with a learnable structure (a fixed random bigram
  table), so the loss falls as a language model's does;
- resnet_fast (issue 45): a fast learner, one rank's share of a ResNet-18/CIFAR-10 DDP run: the same residual
  CNN on 32x32 CIFAR-like images (a smooth class pattern under pixel noise, learnable), AdamW with the
  one-cycle schedule fast CIFAR training uses, a per-rank batch of 32 (256 over 8 ranks); 55 steps (its own
  length, whatever --steps says): the loss falls from ~2.4 to ~0.02, halves within a few steps once the
  learning rate is up, and one rank's batch drops it 2-3x below the level of the steps before (the level
  lags a fall): fast learning, not a collapse.

tests/unit/test_loss_spike.py runs the detector over every trace clean (no finding) and with spikes and
collapses planted at every step it can judge (every one found, at its step; resnet_fast's at steps 6-12, and
a collapse to a thousandth at step 10 of its first 24). Recording resnet_fast alone takes ~25 s of one core.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
sys.path.insert(0, str(ROOT / "tests" / "data" / "scripts"))
OUT = ROOT / "tests" / "data" / "loss_curves" / "traces.json"


def _norm(params: list) -> float:
    import torch

    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0))))


def resnet(seed: int, steps: int) -> dict[str, list[float]]:
    import torch.nn.functional as F
    from resnet_train import batches, build  # tests/data/scripts: the same model the e2e tests train

    model, opt = build(seed)
    data = batches(seed)
    out: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for _ in range(steps):
        x, y = next(data)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        out["loss"].append(float(loss.detach()))
        out["grad_norm"].append(_norm(list(model.parameters())))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def gpt(seed: int, steps: int, accum: int = 2) -> dict[str, list[float]]:
    import torch
    import torch.nn.functional as F
    from gpt_ddp import GPT

    torch.manual_seed(seed)
    vocab, block = 256, 32
    model = GPT(vocab, block, 4, 64, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    g = torch.Generator().manual_seed(2000 + seed)
    table = torch.randint(vocab, (vocab, 4), generator=g)  # each token has 4 likely successors
    out: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for _ in range(steps):
        losses = []
        for _ in range(accum):
            start = torch.randint(vocab, (8, 1), generator=g)
            seq = [start]
            for _ in range(block):
                pick = torch.randint(4, (8, 1), generator=g)
                seq.append(table[seq[-1].squeeze(1)].gather(1, pick))
            idx = torch.cat(seq, 1)
            loss = F.cross_entropy(model(idx[:, :-1]).reshape(-1, vocab), idx[:, 1:].reshape(-1))
            (loss / accum).backward()
            losses.append(float(loss.detach()))
        out["loss"].append(sum(losses) / accum)
        out["grad_norm"].append(_norm(list(model.parameters())))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return out


def resnet_fast(seed: int, steps: int) -> dict[str, list[float]]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from resnet_train import Block

    steps = 55  # the run length: the one-cycle schedule's shape depends on it
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          Block(16), Block(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=steps)
    g = torch.Generator().manual_seed(3000 + seed)
    # Ten classes, each a smooth colour pattern (4x4 upsampled to 32x32) under unit pixel noise.
    patterns = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=32, mode="bilinear", align_corners=False)
    out: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for _ in range(steps):
        y = torch.randint(10, (32,), generator=g)
        x = patterns[y] + 0.5 * torch.randn(32, 3, 32, 32, generator=g)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        out["loss"].append(float(loss.detach()))
        out["grad_norm"].append(_norm(list(model.parameters())))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return out


SCRIPTS = {"resnet": resnet, "gpt": gpt, "resnet_fast": resnet_fast}


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--scripts", nargs="+", choices=sorted(SCRIPTS), default=list(SCRIPTS),
                   help="record these only; the other scripts' traces already in --out are kept")
    args = p.parse_args()
    torch.set_num_threads(1)
    traces = json.loads(args.out.read_text()) if args.out.exists() else {}
    traces.update({name: {str(seed): SCRIPTS[name](seed, args.steps) for seed in range(args.seeds)}
                   for name in args.scripts})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(traces, separators=(",", ":")))
    sizes = {name: f"{len(seeds)} seeds x {len(next(iter(seeds.values()))['loss'])} steps"
             for name, seeds in traces.items()}
    print(f"wrote {args.out}: {', '.join(f'{name} {size}' for name, size in sizes.items())}")


if __name__ == "__main__":
    main()
