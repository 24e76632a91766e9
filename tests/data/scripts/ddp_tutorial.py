"""The pytorch/examples DDP tutorial's loop (distributed/ddp-tutorial-series/multigpu_torchrun.py), on CPU:
every epoch starts with a peek at one batch (``next(iter(self.train_data))``, for its size), then calls
``set_epoch(epoch)`` and trains on a pass. The peek is no epoch: its clean run gives no finding. With
``--no-set-epoch`` the second epoch repeats the first's order: data_order finds it, at the loop's line.

Runs under ``distdebug attach`` (its own process group) or from a test's ranks (``main()``, the group made).
By default three changes from the tutorial, each undone by an option that makes it the upstream script (the
replay's tests of issue 46):
- mse_loss; ``--cross-entropy``: the tutorial's cross_entropy over one output column, 0 whatever the weights;
- no snapshot file; ``--snapshot PATH``: rank 0 saves ``{"MODEL_STATE", "EPOCHS_RUN"}`` after every epoch and
  every rank resumes from it when it is there (a replay that shares the working directory leaks it between runs);
- a seeded dataset; ``--unseeded``: torch.rand without a seed, as the tutorial's: each rank's samples differ.
``--negative-loss`` is none of the tutorial's: minus the softplus of the outputs, summed (below zero at every
step, falling steadily as training pushes the outputs up), a negative loss like the FSDP2 example's sum of
logits."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size, seeded=True):
        g = torch.Generator().manual_seed(0) if seeded else None
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, set_epoch=True, snapshot=None, cross_entropy=False,
                 negative_loss=False):
        self.epochs_run = 0
        self.snapshot = snapshot
        if snapshot is not None and os.path.exists(snapshot):  # upstream: every rank loads, before DDP
            state = torch.load(snapshot)
            model.load_state_dict(state["MODEL_STATE"])
            self.epochs_run = state["EPOCHS_RUN"]
            print(f"[rank{dist.get_rank()}] Resuming training from snapshot at Epoch {self.epochs_run}")
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.set_epoch = set_epoch
        self.loss = F.cross_entropy if cross_entropy else F.mse_loss
        if negative_loss:
            self.loss = lambda output, targets: -F.softplus(output).sum()

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = self.loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[rank{dist.get_rank()}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        if self.set_epoch:
            self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:  # THE LOOP (tests look this line up)
            self._run_batch(source, targets)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.snapshot is not None and dist.get_rank() == 0:  # upstream's save_every 1; EPOCHS_RUN as it
                torch.save({"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}, self.snapshot)


def main(total_epochs=2, batch_size=32, set_epoch=True, snapshot=None, cross_entropy=False, unseeded=False,
         negative_loss=False):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if not unseeded:
        torch.manual_seed(0)
    dataset = MyTrainDataset(256, seeded=not unseeded)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_data = DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                            sampler=DistributedSampler(dataset))
    Trainer(model, train_data, optimizer, set_epoch, snapshot, cross_entropy, negative_loss).train(total_epochs)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--no-set-epoch", action="store_true")
    p.add_argument("--snapshot", default=None, help="the tutorial's snapshot file: saved every epoch, resumed from")
    p.add_argument("--cross-entropy", action="store_true", help="the tutorial's loss (0 over one output column)")
    p.add_argument("--unseeded", action="store_true", help="the tutorial's data: torch.rand, no seed")
    p.add_argument("--negative-loss", action="store_true", help="minus the outputs' softplus, summed: below zero")
    args = p.parse_args()
    main(args.epochs, args.batch_size, not args.no_set_epoch, args.snapshot, args.cross_entropy, args.unseeded,
         args.negative_loss)
    dist.destroy_process_group()
