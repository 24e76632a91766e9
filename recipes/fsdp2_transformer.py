"""FSDP2 (``fully_shard``) transformer language model on synthetic tokens.

    torchrun --nproc-per-node 2 recipes/fsdp2_transformer.py --steps 20
    distdebug attach recipes/fsdp2_transformer.py
    distdebug attach --nproc-per-node 4 recipes/fsdp2_transformer.py --replicate 2   # HSDP

FSDP1 refuses CPU; FSDP2 runs on CPU with gloo, with DTensor parameters sharded across ranks.
Tokens follow a fixed rule (next = (3 * tok + 1) mod vocab) with noise, so the loss falls.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import StepTimer, base_parser, finish, my_rows, param_digest, setup, write_digest  # noqa: E402


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, src_mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        # 2-D logits (batch * seq, vocab): a fresh tensor, not a view, as FSDP2 prefers for outputs.
        return self.head(self.norm(h).reshape(-1, h.shape[-1]))


def batch(step: int, rank: int, size: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100003 + step * 1009 + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    toks = [start]
    for _ in range(seq):
        toks.append((3 * toks[-1] + 1) % vocab)
    out = torch.cat(toks, 1)
    noise = torch.rand(out.shape, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, vocab, out.shape, generator=g), out)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], global_batch=True)
    p.set_defaults(lr=3e-3, batch_size=8)
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP: replicate groups of this size, sharded across world/replicate ranks each")
    args = p.parse_args()
    device = setup(args.seed)
    vocab, seq = 64, 16
    model = TinyLM(vocab=vocab, seq=seq).to(device)
    mesh = None
    if args.replicate > 1:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        if world % args.replicate:
            raise SystemExit(f"--replicate {args.replicate} must divide the world size {world}")
        mesh = init_device_mesh(device.type, (args.replicate, world // args.replicate),
                                mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    loss = torch.tensor(0.0)
    timer = StepTimer()
    for step in range(args.steps):
        if args.global_batch is None:
            data = batch(step, dist.get_rank(), args.batch_size, seq, vocab, args.seed).to(device)
        else:  # the step's global batch, this rank's rows of it
            whole = batch(step, 0, args.global_batch, seq, vocab, args.seed)
            (data,) = my_rows(args, dist.get_world_size(), dist.get_rank(), whole)
            data = data.to(device)
        logits = model(data[:, :-1])
        loss = loss_fn(logits, data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer.tick()
    write_digest(args.digest_out, param_digest(model.named_parameters()), float(loss.detach()), timer)
    finish()


if __name__ == "__main__":
    main()
