"""The pytorch/examples DDP tutorial's loop (distributed/ddp-tutorial-series/multigpu_torchrun.py), on CPU:
every epoch starts with a peek at one batch (``next(iter(self.train_data))``, for its size), then calls
``set_epoch(epoch)`` and trains on a pass. The peek is no epoch: its clean run gives no finding. With
``--no-set-epoch`` the second epoch repeats the first's order: data_order finds it, at the loop's line.

Runs under ``distdebug attach`` (its own process group) or from a test's ranks (``main()``, the group made).
Two changes from the tutorial: mse_loss (the tutorial's cross_entropy over one output column is 0
whatever the weights) and no snapshot file."""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, set_epoch=True):
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.set_epoch = set_epoch

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
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
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def main(total_epochs=2, batch_size=32, set_epoch=True):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_data = DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                            sampler=DistributedSampler(dataset))
    Trainer(model, train_data, optimizer, set_epoch).train(total_epochs)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--no-set-epoch", action="store_true")
    args = p.parse_args()
    main(args.epochs, args.batch_size, not args.no_set_epoch)
    dist.destroy_process_group()
