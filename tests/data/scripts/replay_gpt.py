"""A user's script of the minimal GPT shape, for ``faults replay`` on a script it has never seen: random
token batches drawn per rank (no DataLoader), a tiny causal transformer (no BatchNorm), AdamW, gradients
averaged by hand with all_reduce (no wrapper), no checkpoint. Its clean run must give no finding."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, block: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, 2) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=14)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1337)  # the same seed everywhere: identical initial replicas
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(100 + rank)  # each rank draws its own batches
    data = torch.randint(0, 64, (4096,), generator=g)
    for _ in range(args.iters):
        ix = torch.randint(len(data) - 17, (8,), generator=g)
        xb = torch.stack([data[i:i + 16] for i in ix])
        yb = torch.stack([data[i + 1:i + 17] for i in ix])
        logits = model(xb)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), yb.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for q in model.parameters():
            dist.all_reduce(q.grad)
            q.grad /= world
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    if rank == 0:
        print(f"iter {args.iters}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
