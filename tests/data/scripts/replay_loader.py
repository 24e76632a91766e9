"""A user's script of the common DDP shape, for ``faults replay`` on a script it has never seen:
DataLoader + DistributedSampler, BatchNorm, and a checkpoint saved by rank 0 mid-run and loaded back
by every rank (the way replicated training restores). Its clean run must give no finding."""

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-at", type=int, default=4)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    where = [tempfile.mkdtemp(prefix="replay_loader_") if rank == 0 else None]
    dist.broadcast_object_list(where)  # one directory for the whole job
    ckpt = os.path.join(where[0], "model.pt")
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.cross_entropy(ddp(xb), yb)
            loss.backward()
            opt.step()
            step += 1
            if step == args.save_at:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, ckpt)
                dist.barrier()
                state = torch.load(ckpt, weights_only=True)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
            if step == args.steps:
                break
        epoch += 1
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where[0], ignore_errors=True)
        print(f"final loss {loss.item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
