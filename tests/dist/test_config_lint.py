"""Tier 2 (real gloo ranks, forked): lint's checks on the live DDP objects, after step 1."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distdebug.detectors.config_lint import ConfigLint
from tests.dist.test_replica_divergence import findings
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 1)
        self.spare = nn.Linear(4, 1)  # never called

    def forward(self, x):
        return self.used(x)


def _framework(outer):
    """A DDP builder as a framework has it: accelerate's prepare builds the wrapper, called by the HF Trainer
    (outer="transformers") or by the script (outer="accelerate"): functions of modules with those names."""
    import types

    acc = types.ModuleType("accelerate.accelerator")
    exec("from torch.nn.parallel import DistributedDataParallel as DDP\n"
         "def prepare(model):\n    return DDP(model, find_unused_parameters=True)\n", acc.__dict__)
    if outer == "accelerate":
        return acc.prepare
    trainer = types.ModuleType(f"{outer}.trainer")
    trainer.__dict__["prepare"] = acc.prepare
    exec("def wrap(model):\n    return prepare(model)\n", trainer.__dict__)
    return trainer.wrap


def _loop(rank, world, tmp, case):
    s = start_session(tmp, rank, detectors=[ConfigLint()])
    torch.manual_seed(0)
    if case == "unused":
        model = DDP(Branchy(), find_unused_parameters=True)
    elif case == "all_used":
        model = DDP(nn.Linear(4, 1), find_unused_parameters=True)
    elif case.startswith("built_by_"):  # a framework builds the wrapper: the flag is its, not the script's
        model = _framework(case.removeprefix("built_by_"))(nn.Linear(4, 1))
    elif case == "buffers":
        model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)), broadcast_buffers=False)
    elif case == "compile_first":
        model = DDP(torch.compile(nn.Linear(4, 1), backend="eager"))
    elif case.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), device_id=torch.device("cpu"),
                     use_orig_params=case.endswith("orig"))
    elif case.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    else:
        model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).pow(2).mean().backward()
        if step >= 1 and "torch_clip" in case:  # from step 2 on
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif step >= 1 and "own_clip" in case:
            model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


def run(tmp_path, case):
    spawn_ranks(_loop, 2, tmp=tmp_path, case=case)
    return [(f["severity"], f["subject"], f["step"], f["ranks"]) for f in findings(tmp_path, 1)], findings(tmp_path, 1)


def test_find_unused_parameters_is_judged_by_the_real_gradients(tmp_path):
    got, fs = run(tmp_path / "all", "all_used")
    assert got == [("warning", "find_unused_parameters", 1, [1])] and "wasted" in fs[0]["message"]
    got, fs = run(tmp_path / "unused", "unused")
    assert got == [("info", "find_unused_parameters", 1, [1])]
    assert fs[0]["evidence"]["unused"] == ["spare.weight", "spare.bias"]


def test_find_unused_parameters_fix_is_said_in_the_framework_that_set_it(tmp_path):
    """Issue 22: the HF Trainer sets find_unused_parameters=True itself (through accelerate); telling the user
    to remove a flag the script never wrote sent them looking for a line that is not there."""
    from distdebug.detectors.config_lint import FIND_UNUSED_FIX

    got, fs = run(tmp_path / "t", "built_by_transformers")
    assert got == [("info", "find_unused_parameters", 1, [1])]  # the Trainer's own default: a note, no alarm
    assert fs[0]["fix"] == FIND_UNUSED_FIX["transformers"] and "ddp_find_unused_parameters=False" in fs[0]["fix"]
    assert fs[0]["evidence"]["built_by"] == "transformers" and "set by transformers" in fs[0]["message"]
    got, fs = run(tmp_path / "a", "built_by_accelerate")
    assert fs[0]["fix"] == FIND_UNUSED_FIX["accelerate"] and fs[0]["evidence"]["built_by"] == "accelerate"
    assert got[0][0] == "warning"  # accelerate's default is False: the script asked for it
    _, fs = run(tmp_path / "s", "all_used")  # the script's own DDP: its own line to remove
    assert fs[0]["fix"] == "remove find_unused_parameters=True" and fs[0]["evidence"]["built_by"] == "the script"


def test_buffers_compile_order_and_a_clean_model(tmp_path):
    got, fs = run(tmp_path / "b", "buffers")
    assert got == [("warning", "broadcast_buffers", 1, [1])] and fs[0]["evidence"]["modules"] == ["1"]
    got, _ = run(tmp_path / "c", "compile_first")
    assert got == [("warning", "torch.compile before DDP", 1, [1])]
    got, _ = run(tmp_path / "clean", "clean")
    assert got == []


def test_torch_clip_on_fsdp1_shards_is_an_error_at_its_step_and_the_right_clips_are_not(tmp_path):
    for case in ("fsdp1_torch_clip", "fsdp1_torch_clip_orig"):
        got, fs = run(tmp_path / case, case)
        assert got == [("error", "clip_grad_norm_ on FSDP1", 2, [1])], (case, got)
        assert fs[0]["evidence"]["local_norm"] > 0
    for case in ("fsdp1_own_clip", "fsdp2_torch_clip"):  # FSDP1's own clip, and torch's on FSDP2's DTensors
        got, _ = run(tmp_path / case, case)
        assert got == [], (case, got)
