"""A Lightning script for a parity pair: ``Trainer(devices=1)`` against ``Trainer(devices=2)``, one global batch.

    distdebug attach --parity record --nproc-per-node 1 fw_lightning_parity.py --global-batch 16
    distdebug attach --parity record --nproc-per-node 2 fw_lightning_parity.py --global-batch 16

Written the usual way: a LightningModule, a shuffled DataLoader of one data set, ``seed_everything``, gradients
clipped by norm (``gradient_clip_val``: torch's clip_grad_norm_ on the averaged gradients, one norm on every rank);
the Trainer (strategy "ddp", devices from the launcher) puts a DistributedSampler in, which deals the shuffled
samples out to the ranks in turn, so the ranks' batches of ``--global-batch / devices`` samples together are the
one device's.
Lightning is a test extra of distdebug, never a runtime dependency: tests skip this script where it is missing.
"""

import os
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from recipes._common import base_parser, finish, share  # noqa: E402


class Net(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    p = base_parser(__doc__, global_batch=True)
    p.set_defaults(lr=1e-2, steps=10, global_batch=16)
    args = p.parse_args()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    L.seed_everything(args.seed, verbose=False)
    g = torch.Generator().manual_seed(1000 + args.seed)
    x = torch.randn(512, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    train = DataLoader(TensorDataset(x, y), batch_size=share(args, devices), shuffle=True)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp", max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, num_sanity_val_steps=0, gradient_clip_val=0.5)
    trainer.fit(Net(args.lr), train)
    finish()


if __name__ == "__main__":
    main()
