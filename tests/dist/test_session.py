"""Tier 2 (real gloo ranks, forked): what the Session discovers and records in real training loops.

Each test runs a small loop on 2 forked ranks joined by gloo, with a Session installed exactly as
the bootstrap installs it, then reads back the rank's event stream.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import distdebug
from distdebug.artifacts import layout
from distdebug.artifacts.reader import read_events
from distdebug.artifacts.writer import EventWriter
from distdebug.context import RankIdentity
from distdebug.detectors.base import Detector
from distdebug.detectors.loss_nonfinite import LossNonFinite
from distdebug.runtime.session import Session
from tests.helpers import spawn_ranks


def start_session(tmp, rank, detectors=None):
    writer = EventWriter(layout.events_path(tmp, rank))
    s = Session(RankIdentity.from_env(), writer, detectors if detectors is not None else [LossNonFinite()],
                run_dir=tmp, rank_dir=layout.rank_dir(tmp, rank), echo=False)
    s.install()
    return s


def records(tmp, rank, kind=None):
    recs, damaged = read_events(layout.events_path(tmp, rank))
    assert damaged == 0
    return [r for r in recs if kind is None or r["kind"] == kind]


def _ddp_loop(rank, world, tmp, accumulate=1):
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = start_session(tmp, rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    seen = []
    for step in range(3):
        micro = []
        for _ in range(accumulate):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = nn.functional.mse_loss(ddp(x), x[:, :1])
            loss.backward()
            micro.append(float(loss))
        opt.step()
        opt.zero_grad()
        seen.append(sum(micro) / len(micro))
    s.close(0)
    return seen


def test_ddp_loop_discovery_and_exact_losses(tmp_path):
    seen = spawn_ranks(_ddp_loop, 2, tmp=tmp_path)
    for rank in (0, 1):
        (disc,) = records(tmp_path, rank, "discovery")
        (model,) = disc["models"]
        assert model["wrapper"] == "ddp" and model["class"] == "Sequential"
        assert model["batchnorm_modules"] == 1 and model["parameters"] == 4 * 8 + 8 + 16 + 8 + 1
        assert disc["optimizers"][0]["class"] == "SGD" and disc["step_source"] == "optimizer"
        assert disc["process_group"] == {"backend": "gloo", "world_size": 2, "rank": rank}
        assert disc["loss_modules"] == []
        steps = records(tmp_path, rank, "step")
        assert [r["step"] for r in steps] == [1, 2, 3]
        assert [r["loss"] for r in steps] == seen[rank]  # the very values the script computed
        (end,) = records(tmp_path, rank, "end")
        assert end["steps"] == 3 and end["exit_code"] == 0
        assert records(tmp_path, rank, "finding") == []


def test_gradient_accumulation_counts_backwards_and_averages_loss(tmp_path):
    seen = spawn_ranks(_ddp_loop, 2, tmp=tmp_path, accumulate=2)
    steps = records(tmp_path, 0, "step")
    assert [r["backward_calls"] for r in steps] == [2, 2, 2]
    assert [r["loss"] for r in steps] == seen[0]


def _manual_allreduce(rank, world, tmp):
    s = start_session(tmp, rank)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = model(torch.ones(2, 3) * (rank + 1)).sum()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        dist.all_reduce(loss.detach().clone())  # a logging all-reduce is not gradient sync
        opt.step()
        opt.zero_grad()
    s.close(0)
    return [p.detach().tolist() for p in model.parameters()]


def test_plain_module_with_hand_written_allreduce(tmp_path):
    params = spawn_ranks(_manual_allreduce, 2, tmp=tmp_path)
    assert params[0] == params[1]  # the hand-written gradient sync really ran
    (disc,) = records(tmp_path, 1, "discovery")
    assert disc["models"][0]["wrapper"] == "manual"
    assert [r["collectives"] for r in records(tmp_path, 1, "step")] == [3, 3]


def _fsdp2(rank, world, tmp):
    from torch.distributed.fsdp import fully_shard

    s = start_session(tmp, rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    s.close(0)


def test_fsdp2_is_discovered_with_the_users_class_name(tmp_path):
    spawn_ranks(_fsdp2, 2, tmp=tmp_path)
    (disc,) = records(tmp_path, 0, "discovery")
    (model,) = disc["models"]
    assert model["wrapper"] == "fsdp2" and model["class"] == "Sequential"
    assert model["parameters"] == 4 * 4 + 4 + 4 * 2 + 2  # full size, not the shard
    assert len(records(tmp_path, 0, "step")) == 2


def _explicit(rank, world, tmp, call_step=True):
    s = start_session(tmp, rank)
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    distdebug.watch(model)
    for _ in range(4):
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        if call_step:
            distdebug.step(loss)
    s.close(0)


def test_explicit_api_marks_steps_in_loops_without_torch_optim(tmp_path):
    spawn_ranks(_explicit, 2, tmp=tmp_path)
    steps = records(tmp_path, 0, "step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    (disc,) = records(tmp_path, 0, "discovery")
    assert disc["step_source"] == "explicit" and disc["models"][0]["class"] == "Linear"


def test_loop_without_boundaries_gets_a_harness_hint(tmp_path):
    spawn_ranks(_explicit, 2, tmp=tmp_path, call_step=False)
    (f,) = records(tmp_path, 0, "finding")
    assert f["detector"] == "harness" and f["subject"] == "step boundaries"
    assert "distdebug.step" in f["fix"]


class Boom(Detector):
    name = "boom"

    def on_step(self, event):
        if event.step == 2:
            raise ValueError("kaput")
        return ()


def _with_boom(rank, world, tmp):
    s = start_session(tmp, rank, detectors=[Boom(), LossNonFinite()])
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(4):
        loss = model(torch.ones(1, 2)).sum() * (float("nan") if i == 3 else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    s.close(0)
    return [d.name for d in s.detectors]


def test_raising_detector_is_switched_off_and_reported_others_go_on(tmp_path):
    active = spawn_ranks(_with_boom, 2, tmp=tmp_path)
    assert active == [["loss_nonfinite"], ["loss_nonfinite"]]
    findings = records(tmp_path, 1, "finding")
    harness = [f for f in findings if f["detector"] == "harness"]
    assert len(harness) == 1
    assert harness[0]["subject"] == "detector:boom" and harness[0]["step"] == 2
    assert "ValueError: kaput" in harness[0]["message"] and harness[0]["ranks"] == [1]
    nan = [f for f in findings if f["detector"] == "loss_nonfinite"]
    assert nan[0]["step"] == 4  # the remaining detector still saw step 4
    assert len(records(tmp_path, 1, "step")) == 4


class HookBoom(Detector):
    """A detector whose forward hook (mode "hook") or whose patch of torch.save (mode "patch") raises
    in step 3."""

    name = "hookboom"

    def __init__(self, mode):
        self.mode = mode
        self.step = 1
        self.calls = 0

    def setup(self, ctx):
        det = self

        def make(original):
            def save(obj, f, *args, **kwargs):
                if det.mode == "patch" and det.step == 3:
                    raise RuntimeError("patch bug")
                return original(obj, f, *args, **kwargs)
            return save

        self.patch(ctx, torch, "save", make)

    def attach(self, ctx):
        self.hook(ctx.models[0], "forward", self._fwd)

    def _fwd(self, module, args, out):
        self.calls += 1
        if self.mode == "hook" and self.step == 3:
            raise ValueError("hook bug")

    def on_step(self, event):
        self.step = event.step + 1
        return ()


def _hook_boom(rank, world, tmp, mode):
    import io

    from torch.nn.parallel import DistributedDataParallel as DDP

    det = HookBoom(mode)
    s = start_session(tmp, rank, detectors=[det, LossNonFinite()]) if mode else None
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    saved = []
    for step in range(1, 6):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        buf = io.BytesIO()
        torch.save({"step": step}, buf)  # the user's own save still happens, also when the patch raises
        saved.append(len(buf.getvalue()) > 0)
    digest = [float(p.detach().double().sum()) for p in ddp.parameters()]
    if s is not None:
        s.close(0)
    return digest, saved, det.calls, [d.name for d in s.detectors] if s else None


@pytest.mark.parametrize("mode, error, calls", [("hook", "ValueError: hook bug", 2),
                                                ("patch", "RuntimeError: patch bug", 1)])
def test_a_raising_hook_or_patch_switches_its_detector_off_and_training_goes_on(tmp_path, mode, error, calls):
    bare = spawn_ranks(_hook_boom, 2, tmp=tmp_path / "bare", mode=None)
    under = spawn_ranks(_hook_boom, 2, tmp=tmp_path / "attached", mode=mode)
    for rank in range(2):
        digest, saved, ran, active = under[rank]
        assert digest == bare[rank][0]  # bitwise the same training
        assert saved == [True] * 5  # the user's torch.save ran every time
        # The hook ran until the detector was switched off (the patch raises after step 2's forward), then
        # it was removed: no call after that.
        assert ran == calls
        assert active == ["loss_nonfinite"]
        (f,) = [f for f in records(tmp_path / "attached", rank, "finding") if f["detector"] == "harness"]
        assert f["subject"] == "detector:hookboom" and f["step"] == 2  # raised after step 2's boundary
        assert error in f["message"] and "hooks removed" in f["message"]
