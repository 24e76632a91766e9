"""Carries planted secrets into everything distdebug records: its environment (DATABASE_URL with a
password, a bearer token), its command line (--api-key VALUE, --password=VALUE), and an error
message that quotes them (the script_error record and the traceback)."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--api-key")
p.add_argument("--password")
args = p.parse_args()
dist.init_process_group("gloo")
model = nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
dist.destroy_process_group()
raise RuntimeError(f"upload failed: {os.environ['DATABASE_URL']} {os.environ['AUTH_HEADER']} key {args.api_key} "
                   f"pw {args.password} hf {os.environ['HF_TOKEN']}")
