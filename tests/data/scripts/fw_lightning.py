"""A PyTorch Lightning script written the usual way (``Trainer(strategy="ddp")`` under torchrun, CPU, gloo):
a BatchNorm model, validation with ``sync_dist`` logging, a checkpoint Lightning writes itself
(``trainer.save_checkpoint``: torch.save into a BytesIO, written through fsspec) and a second fit that resumes
from it (``fit(ckpt_path=...)``: torch.load from an fsspec file object). Final parameter digests per rank.

Lightning is a test extra of distdebug, never a runtime dependency: tests skip this script where it is missing.
"""

import json
import os
import sys
import tempfile

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from _disk import corrupt_torch_zip  # noqa: E402

from recipes._common import base_parser, finish, param_digest, write_digest  # noqa: E402

BATCH_LOSSES: list[float] = []  # every training batch's loss, as the script computed it


class Net(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
        self.last_loss = float("nan")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        BATCH_LOSSES.append(float(loss.detach()))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.last_loss = float(outputs["loss"])

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def trainer(max_steps: int, accumulate: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), strategy="ddp",
                     max_steps=max_steps, val_check_interval=5 * accumulate, limit_val_batches=4, logger=False,
                     accumulate_grad_batches=accumulate,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     deterministic=True, num_sanity_val_steps=0)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--save-at", type=int, default=8, help="steps of the first fit; its checkpoint is resumed")
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    p.add_argument("--corrupt-on-disk", action="store_true",
                   help="change one byte of the checkpoint's first tensor on disk before the resume reads it")
    args = p.parse_args()
    L.seed_everything(args.seed, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    train = DataLoader(TensorDataset(x[:1792], y[:1792]), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(TensorDataset(x[1792:], y[1792:]), batch_size=32)
    model = Net(args.lr)
    first = trainer(args.save_at, args.accumulate)
    first.fit(model, train, val)
    where = [tempfile.mkdtemp(prefix="fw_lightning_") if first.global_rank == 0 else None]
    dist.broadcast_object_list(where)
    ckpt = os.path.join(where[0], "last.ckpt")
    first.save_checkpoint(ckpt)  # Lightning writes on rank 0 and waits for it on every rank
    if args.corrupt_on_disk and first.global_rank == 0:
        corrupt_torch_zip(ckpt)  # the model's first parameter, state_dict.net.0.weight
    dist.barrier()
    resumed = Net(args.lr)
    second = trainer(args.steps, args.accumulate)
    second.fit(resumed, train, val, ckpt_path=ckpt)
    write_digest(args.digest_out, param_digest(resumed.named_parameters()), resumed.last_loss)
    if args.digest_out:  # each optimizer step's loss: the mean of its accumulated batches' losses
        n = args.accumulate
        steps = [sum(BATCH_LOSSES[i:i + n]) / n for i in range(0, len(BATCH_LOSSES) - n + 1, n)]
        with open(os.path.join(args.digest_out, f"losses{second.global_rank}.json"), "w") as f:
            json.dump(steps, f)
    dist.barrier()
    if second.global_rank == 0:
        for name in os.listdir(where[0]):
            os.remove(os.path.join(where[0], name))
        os.rmdir(where[0])
    finish()


if __name__ == "__main__":
    main()
