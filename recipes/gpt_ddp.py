"""A GPT-style language model under DDP: the realistic step the overhead targets are measured on.

    distdebug attach recipes/gpt_ddp.py --steps 40
    python bench/attach_overhead.py                # the in-job A/B on this recipe (issue 18)

Shaped like nanoGPT (token and position embeddings, pre-norm blocks of causal self-attention and an
MLP, weight-tied head, AdamW with weight decay on matrices only, gradient clipping, a cosine learning
rate), on synthetic tokens drawn per rank and step (no download). Sized so that a step takes 50 ms or
more with 2 ranks on a 2-core CPU; deterministic under --seed, and bitwise identical under attach.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import StepTimer, base_parser, finish, my_rows, param_digest, setup, write_digest  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, dim: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as GPT-2
        for m in self.modules():  # GPT-2's initialisation (N(0, 0.02), zero biases)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        """The logits; given ``targets``, nanoGPT's ``(logits, loss)``: the loss computed inside the model."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], global_batch=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=64, help="context length (tokens)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (no_sync on all but the last)")
    p.add_argument("--loss-in-model", action="store_true",
                   help="the model returns (logits, loss), as nanoGPT's does, instead of the logits")
    p.set_defaults(batch_size=8, lr=3e-3, steps=40)
    args = p.parse_args()
    device = setup(args.seed)
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = GPT(args.vocab, args.block, args.layers, args.dim, args.heads).to(device)
    ddp = DDP(model)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    rest = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    rank = dist.get_rank()
    loss = torch.tensor(0.0)
    timer = StepTimer()
    for step in range(1, args.steps + 1):
        for micro in range(args.grad_accum):
            if args.global_batch is None:
                g = torch.Generator().manual_seed(args.seed * 100003 + step * 1009 + micro * 31 + rank)
                idx = torch.randint(args.vocab, (args.batch_size, args.block + 1), generator=g).to(device)
            else:  # this rank's rows of the micro-batch's global batch
                g = torch.Generator().manual_seed(args.seed * 100003 + step * 1009 + micro * 31)
                whole = torch.randint(args.vocab, (args.global_batch, args.block + 1), generator=g)
                (idx,) = my_rows(args, dist.get_world_size(), rank, whole)
                idx = idx.to(device)
            last = micro == args.grad_accum - 1
            with ddp.no_sync() if not last else contextlib.nullcontext():
                if args.loss_in_model:
                    logits, loss = ddp(idx[:, :-1], idx[:, 1:])
                else:
                    logits = ddp(idx[:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, args.vocab), idx[:, 1:].reshape(-1))
                (loss / args.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        timer.tick()
    write_digest(args.digest_out, param_digest(model.named_parameters()), float(loss.detach()), timer)
    finish()


if __name__ == "__main__":
    main()
