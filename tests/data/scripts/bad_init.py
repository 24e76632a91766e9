"""init_process_group with an argument torch refuses (device_id must be an accelerator with an index):
the script's own error at start-up, not a connection problem."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo", device_id=torch.device("cpu"))
