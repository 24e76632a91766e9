"""Real loop shapes under DDP, combinable: --shapes a,b,... (see SHAPES). Final parameter digests per rank.

sched      an LR scheduler stepped every step          clip       gradient clipping by norm
eval       model.eval() validation forwards between steps (no_grad)
infer      a torch.no_grad inference-only phase        ema        an EMA copy of the model, updated each step
frozen     some parameters frozen (requires_grad False)
late       a parameter group added to the optimizer after step 3
accum      gradient accumulation: 2 micro-batches per step, the first under no_sync()
tied       tied weights (embedding and output projection)
workers    a DataLoader with num_workers=2, persistent workers, a DistributedSampler
ckpt       activation checkpointing (torch.utils.checkpoint)
bf16       bf16 autocast
gan        two models and two optimizers (a GAN's generator and discriminator)
closure    optimizer.step(closure): the closure runs forward and backward (Lightning's training step)
phase2     halfway, a new model and optimizer take over while the first stay alive (a second Trainer.fit
           that resumes, a kept Trainer); the same with ``rebuild``, the first dropped (a new Trainer)
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from recipes._common import base_parser, finish, param_digest, setup, write_digest  # noqa: E402

SHAPES = {"sched", "clip", "eval", "infer", "ema", "frozen", "late", "accum", "tied", "workers", "ckpt", "bf16", "gan",
          "closure", "phase2", "rebuild"}


class Net(nn.Module):
    def __init__(self, tied: bool, ckpt: bool):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 32, bias=False)
        self.extra = nn.Linear(16, 16)
        if tied:
            self.head.weight = self.emb.weight
        self.ckpt = ckpt

    def forward(self, tokens):
        h = self.emb(tokens).mean(1)
        h = checkpoint(self.body, h, use_reentrant=False) if self.ckpt else self.body(h)
        return self.head(h + self.extra(h))


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--shapes", default="")
    args = p.parse_args()
    shapes = {s for s in args.shapes.split(",") if s}
    assert shapes <= SHAPES, shapes - SHAPES
    setup(args.seed)
    rank = dist.get_rank()
    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (256, 6), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 32, (256,), generator=torch.Generator().manual_seed(2))
    data = TensorDataset(tokens, targets)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=2 if "workers" in shapes else 0,
                        persistent_workers="workers" in shapes)
    if "gan" in shapes:
        gen, disc = DDP(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))), DDP(nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
        opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
        opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(10 + rank)
        bce = nn.BCEWithLogitsLoss()
        for _ in range(args.steps):
            real, z = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
            loss_d = bce(disc(real), torch.ones(8, 1)) + bce(disc(gen(z).detach()), torch.zeros(8, 1))
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = bce(disc(gen(z)), torch.ones(8, 1))
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
        params = list(gen.module.named_parameters()) + list(disc.module.named_parameters())
        write_digest(args.digest_out, param_digest(params), float(loss_g.detach()))
        finish()
        return
    model = Net("tied" in shapes, "ckpt" in shapes)
    if "frozen" in shapes:
        for q in model.body[0].parameters():
            q.requires_grad_(False)
    late_params = list(model.extra.parameters()) if "late" in shapes else []
    ddp = DDP(model)
    base = [q for q in model.parameters() if q.requires_grad and all(q is not x for x in late_params)]
    opt = torch.optim.SGD(base, lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if "sched" in shapes else None
    ema = copy.deepcopy(model) if "ema" in shapes else None
    lossf = nn.CrossEntropyLoss()
    step, epoch = 0, 0
    loss = torch.zeros(())
    while step < args.steps:
        sampler.set_epoch(epoch)
        epoch += 1
        batches = iter(loader)
        for x, y in batches:
            micro = [(x[:4], y[:4]), (x[4:], y[4:])] if "accum" in shapes else [(x, y)]
            if "closure" in shapes:
                def closure(x=x, y=y, ddp=ddp):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled="bf16" in shapes):
                        out = lossf(ddp(x).float(), y)
                    out.backward()
                    return out

                loss = opt.step(closure)
                opt.zero_grad()
                step += 1
                if step >= args.steps:
                    break
                continue
            for i, (mx, my) in enumerate(micro):
                ctx = ddp.no_sync() if i < len(micro) - 1 else torch.enable_grad()
                with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled="bf16" in shapes):
                    loss = lossf(ddp(mx).float(), my) / len(micro)
                loss.backward()
            if "clip" in shapes:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            step += 1
            if sched is not None:
                sched.step()
            if ema is not None:
                with torch.no_grad():
                    for e, q in zip(ema.parameters(), model.parameters(), strict=True):
                        e.mul_(0.9).add_(q.detach(), alpha=0.1)
            if step == args.steps // 2 and shapes & {"phase2", "rebuild"}:
                kept = (ddp, opt) if "phase2" in shapes else None  # noqa: F841 (alive on purpose)
                model = Net("tied" in shapes, "ckpt" in shapes)
                model.load_state_dict(ddp.module.state_dict())  # the second phase resumes from the first
                ddp = DDP(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
            if step == 3 and late_params:
                opt.add_param_group({"params": late_params, "lr": 0.01})
            if "eval" in shapes and step % 2 == 0:
                ddp.eval()
                with torch.no_grad():
                    for _ in range(5):
                        ddp(tokens[:8])
                ddp.train()
            if step >= args.steps:
                break
    if "infer" in shapes:
        with torch.no_grad():
            for _ in range(20):
                model(tokens[:16])
    write_digest(args.digest_out, param_digest(model.named_parameters()), float(loss.detach()))
    finish()


if __name__ == "__main__":
    main()
