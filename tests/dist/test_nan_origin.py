"""Tier 2 (real gloo ranks, forked): the first NaN is traced to its step, origin rank, parameter and module,
even after all-reduce has spread it to every rank."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distdebug.detectors.nan_origin import NanOrigin
from tests.dist.test_replica_divergence import findings
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _ddp(rank, world, tmp, fault=None, fault_rank=1, detector=True, steps=5, bucket_view=False, accum=False,
         watch="on-demand"):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distdebug.config import NanOriginConfig

    s = start_session(tmp, rank, detectors=[NanOrigin(NanOriginConfig(watch=watch))] if detector else [])
    model = _model()
    state = {"step": 0}
    if fault == "grad":  # one rank's local gradient of 2.weight, before DDP reduces it (the first micro-batch's)
        model[2].weight.register_hook(
            lambda g: g * float("nan") if rank == fault_rank and state["step"] == 3 and state["micro"] == 0 else g)
    if fault == "activation":  # one module's output (the middle Linear, "2") on one rank
        def poison(module, args, out):
            if rank == fault_rank and state["step"] == 3:
                out = out.clone()
                out[0, 0] = float("nan")
                return out
        model[2].register_forward_hook(poison)
    ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    det = s.detectors[0] if detector else None
    norms = []
    counting = torch._foreach_norm

    def counted(*args, **kwargs):
        norms.append(1)
        return counting(*args, **kwargs)

    torch._foreach_norm = counted  # how many passes over a set of tensors the detector makes (restored below)
    # On a CPU the passes run on the host (fingerprint.hostpass): counted alike, when they answered
    from distdebug.fingerprint.hostpass import HostPass

    host = {name: getattr(HostPass, name) for name in ("norms", "any_nonfinite")}

    def host_counted(name):
        def call(self, tensors):
            out = host[name](self, tensors)
            if out is not None:
                norms.append(1)
            return out
        return call

    for name in host:
        setattr(HostPass, name, host_counted(name))
    for step in range(1, steps + 1):
        state["step"] = step
        for micro in range(2 if accum else 1):  # accumulation: the first micro-batch under no_sync()
            state["micro"] = micro
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
            with ddp.no_sync() if accum and micro == 0 else contextlib.nullcontext():
                ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if fault == "write" and rank == fault_rank and step == 3:  # a write between the steps (not the update)
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")
        if det is not None and step == 1:
            # DDP's default reduces copies: the local gradients are read once per backward, with no hook
            # per parameter; gradients that are bucket views need one each
            per_param = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
            state["hooks"] = (len(s.ctx.end_of_backward), per_param)
    torch._foreach_norm = counting
    for name, fn in host.items():
        setattr(HostPass, name, fn)
    state["norms_per_step"] = len(norms) / steps
    out = [float(x) for p in model.parameters() for x in p.detach().flatten()]
    dist.destroy_process_group()
    s.close(0)
    return out, state.get("hooks"), state["norms_per_step"]


@pytest.mark.parametrize("bucket_view", [False, True])
def test_nan_in_one_ranks_local_gradient_names_that_rank_step_and_parameter(tmp_path, bucket_view):
    res = spawn_ranks(_ddp, 3, tmp=tmp_path, fault="grad", fault_rank=1, bucket_view=bucket_view)
    assert [hooks for _, hooks, _ in res] == [(0, 6) if bucket_view else (1, 0)] * 3
    origin, summary = findings(tmp_path, 1)
    assert summary["message"] == "values stayed non-finite in 3 steps from step 3 on"  # one finding, then a count
    assert (origin["detector"], origin["severity"], origin["step"], origin["subject"], origin["ranks"]) == \
        ("nan_origin", "error", 3, "2.weight", [1])
    assert "NaN/Inf started on rank 1 at step 3" in origin["message"]
    for rank in (0, 2):  # all-reduce spread it: they received it, and say so
        f = findings(tmp_path, rank)[0]
        assert (f["severity"], f["step"], f["subject"]) == ("warning", 3, "gradients")
        assert "through all-reduce" in f["message"] and f["evidence"]["local_gradients_nonfinite"] == []


@pytest.mark.parametrize("watch", ["on-demand", "full"])
def test_nan_produced_in_forward_names_the_module(tmp_path, watch):
    # on demand: the step found non-finite is re-executed with the module hooks on; full: they are always on
    spawn_ranks(_ddp, 2, tmp=tmp_path, fault="activation", fault_rank=0, watch=watch)
    f = findings(tmp_path, 0)[0]
    assert f["evidence"]["watch"] == watch
    assert (f["step"], f["ranks"]) == (3, [0]) and "started on rank 0" in f["message"]
    assert f["evidence"]["first_nonfinite_module_output"] == "2"
    assert "first non-finite module output in forward order: 2" in f["message"]
    assert "through all-reduce" in findings(tmp_path, 1)[0]["message"]


def test_clean_run_no_finding_and_training_bitwise_unchanged(tmp_path):
    # The DDP communication hook must reduce exactly as DDP does on its own (3 ranks: 1/3 is inexact); the
    # on-demand capture (a copy of the parameters, the inputs, the generators' states) changes nothing.
    bare = spawn_ranks(_ddp, 3, tmp=tmp_path / "bare", detector=False)
    for watch in ("on-demand", "full"):
        watched = spawn_ranks(_ddp, 3, tmp=tmp_path / watch, watch=watch)
        assert [params for params, _, _ in watched] == [params for params, _, _ in bare]
        assert all(findings(tmp_path / watch, r) == [] for r in range(3))


def test_parameters_written_between_the_steps_are_named_so(tmp_path):
    """On demand, the step found non-finite has its parameters as its forward found them (the capture): a NaN
    written into 2.weight after step 3's update (finite at step 3's end, where the parameters are checked) is
    told as a write between the steps, at step 4, naming the parameter; not as module 2's output."""
    spawn_ranks(_ddp, 2, tmp=tmp_path, fault="write", fault_rank=1)
    f = findings(tmp_path, 1)[0]
    assert (f["severity"], f["step"], f["ranks"], f["subject"]) == ("error", 4, [1], "2.weight")
    assert "written between the steps" in f["message"]
    assert f["evidence"]["parameters_nonfinite_before_step"] == ["2.weight"]
    assert "through all-reduce" in findings(tmp_path, 0)[0]["message"]


def test_accumulation_under_no_sync_reads_the_local_gradients_once_a_step(tmp_path):
    """Two micro-batches a step, the first under DDP's no_sync(): its gradients accumulate, still local, into
    the backward that syncs, so the one reading there finds a NaN born in the first micro-batch, on its rank
    (issue 18: a pass over the gradients per step, not per micro-batch). Training stays bitwise."""
    watched = spawn_ranks(_ddp, 3, tmp=tmp_path / "nan", fault="grad", fault_rank=1, accum=True)
    origin = findings(tmp_path / "nan", 1)[0]
    assert (origin["detector"], origin["step"], origin["subject"], origin["ranks"]) == \
        ("nan_origin", 3, "2.weight", [1])
    clean = spawn_ranks(_ddp, 3, tmp=tmp_path / "clean", accum=True)
    bare = spawn_ranks(_ddp, 3, tmp=tmp_path / "bare", accum=True, detector=False)
    assert [params for params, _, _ in clean] == [params for params, _, _ in bare]
    assert all(findings(tmp_path / "clean", r) == [] for r in range(3))
    # per step: one reading of the local gradients (at the syncing backward) and one of the parameters
    assert [n for _, _, n in clean] == [2.0] * 3 and [n for _, _, n in bare] == [0.0] * 3
    assert watched


def _manual(rank, world, tmp, fault_rank=2):
    s = start_session(tmp, rank, detectors=[NanOrigin()])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 5):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        if rank == fault_rank and step == 2:
            model[0].bias.grad[1] = float("inf")
        for p in model.parameters():  # a hand-written gradient sync
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


def test_hand_written_all_reduce_loop_names_the_origin_rank(tmp_path):
    spawn_ranks(_manual, 3, tmp=tmp_path)
    f = findings(tmp_path, 2)[0]
    assert (f["step"], f["subject"], f["ranks"], f["severity"]) == (2, "0.bias", [2], "error")
    assert f["evidence"]["local_gradients_seen_by"] == "all_reduce"
    assert findings(tmp_path, 0)[0]["severity"] == "warning"


def _fsdp(rank, world, tmp):
    from torch.distributed.fsdp import fully_shard

    s = start_session(tmp, rank, detectors=[NanOrigin()])
    model = _model()

    def poison(module, args, out):
        if rank == 0 and s.step + 1 == 3:
            out = out.clone()
            out[0, 0] = float("nan")
            return out
    model[0].register_forward_hook(poison)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 5):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


def test_fsdp2_origin_is_the_rank_whose_forward_made_it(tmp_path):
    # FSDP2 reduces gradients inside; the forward comes before any reduction, so the rank whose forward
    # made the first non-finite output is the origin, and the rank it reached through reduce-scatter
    # (finite forward and loss) is told it received it.
    spawn_ranks(_fsdp, 2, tmp=tmp_path, timeout=120)
    (f,) = [f for f in findings(tmp_path, 0) if f["severity"] != "info"]
    assert (f["step"], f["ranks"], f["subject"], f["severity"]) == (3, [0], "0", "error")
    assert f["message"].startswith("NaN/Inf started on rank 0 at step 3")
    assert f["evidence"]["origin"] == "this rank (forward)"
    (g,) = [f for f in findings(tmp_path, 1) if f["severity"] != "info"]
    assert (g["step"], g["severity"], g["subject"], g["evidence"]["origin"]) == \
        (3, "warning", "gradients", "another rank")


def _normed(rank, world, tmp, nan_input_rank=None, watch="full"):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distdebug.config import NanOriginConfig

    s = start_session(tmp, rank, detectors=[NanOrigin(NanOriginConfig(watch=watch))])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    hooked = None
    for step in range(1, 5):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        if rank == nan_input_rank and step == 3:
            x[2, 1] = float("nan")  # a bad batch on one rank
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 2:  # the module hooks come in at the end of step 1
            hooked = sorted(name or "root" for name, m in model.named_modules()
                            if m._forward_hooks or m._forward_pre_hooks)
    dist.destroy_process_group()
    s.close(0)
    return hooked


@pytest.mark.parametrize("watch", ["full", "on-demand"])
def test_modules_that_cannot_start_a_nan_get_no_hook_and_a_bad_batch_is_named(tmp_path, watch):
    """LayerNorm, GELU and SiLU give finite outputs from finite inputs and parameters (checked every step):
    no hook on them, the model's input is checked instead, and a NaN in one rank's batch is named as that.
    On-demand watch hooks the root alone in every step (the capture); the module hooks come only while
    the step found non-finite is re-executed, and name the same thing."""
    hooked = spawn_ranks(_normed, 2, tmp=tmp_path, nan_input_rank=1, watch=watch)
    # the Linears, and the root's input; on demand, the root's capture alone
    assert hooked == [["0", "3", "5", "root"] if watch == "full" else ["root"]] * 2
    f = findings(tmp_path, 1)[0]
    assert (f["severity"], f["step"], f["ranks"], f["subject"]) == ("error", 3, [1], "(input of Sequential)")
    assert "NaN/Inf started on rank 1 at step 3" in f["message"]
    assert findings(tmp_path, 0)[0]["severity"] == "warning"  # received through all-reduce


def test_large_finite_fp16_gradients_are_not_read_as_non_finite():
    """The end-of-backward reading (runtime.localgrads, shared with loss_spike) takes each local gradient's
    norm in float32: an fp16 gradient of 60000s has a 2-norm past fp16's 65504, and in fp16 it read as Inf
    (a false NaN); a real Inf still reads as one."""
    from distdebug.runtime.localgrads import LocalGradNorms

    model = nn.Module()
    model.big = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    model.big.grad = torch.full((4,), 60000.0, dtype=torch.float16)
    model.bad = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    model.bad.grad = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    det = NanOrigin()
    shared = LocalGradNorms(model)
    shared.listeners.append(det._local_norms)
    shared()
    ((names, flags),) = det.local.items()
    assert names == ("big", "bad") and flags.dtype == torch.float32
    assert torch.isfinite(flags).tolist() == [True, False]


def _huge(rank, world, tmp):
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = start_session(tmp, rank, detectors=[NanOrigin()])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-30)
    for step in range(1, 5):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        scale = 1e21 if step == 3 else 1.0  # finite gradients of ~1e21: their float32 squares overflow
        (ddp(x).mean() * scale).backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


def test_a_finite_gradient_whose_norm_overflows_is_not_called_non_finite(tmp_path):
    """The shared 2-norm of a finite gradient past ~1e19 overflows float32 (Inf); the rare path looks at the
    values themselves (reduced gradients, parameters, loss, forward) before it calls anything non-finite."""
    spawn_ranks(_huge, 2, tmp=tmp_path)
    for rank in (0, 1):
        assert [f for f in findings(tmp_path, rank) if f["detector"] == "nan_origin"] == []

# ---------------------------------------------------------------- finite values near the dtype's maximum
class Amplify(nn.Module):
    """The script's own module (hooked: not a torch.nn class): finite activations up to 3e38, near float32's
    maximum, whose float32 sum is Inf."""

    def forward(self, x):
        return torch.sigmoid(x) * 3e38


class Shrink(nn.Module):
    def forward(self, x):
        return x * 1e-38


class Poison(nn.Module):
    """A real NaN, later in the forward than the large values, on one rank at one step."""

    def __init__(self, rank, state):
        super().__init__()
        self.rank, self.state = rank, state

    def forward(self, x):
        if self.state.get("poison") == self.rank and self.state["step"] == 3:
            x = x.clone()
            x[0, 0] = float("nan")
        return x


def _large(rank, world, tmp, watch, poison_rank=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distdebug.config import NanOriginConfig

    s = start_session(tmp, rank, detectors=[NanOrigin(NanOriginConfig(watch=watch))])
    torch.manual_seed(0)
    state = {"step": 0, "poison": poison_rank}
    model = nn.Sequential(nn.Linear(4, 16), Amplify(), nn.Tanh(), Shrink(), nn.Linear(16, 8), Poison(rank, state),
                          nn.Linear(8, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(1, 6):
        state["step"] = step
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


# The quick tier keeps one shape of each family; the others run in the full suite (CI).
@pytest.mark.parametrize("watch", [pytest.param("full", marks=pytest.mark.slow), "on-demand"])
def test_large_finite_activations_are_finite_and_a_later_nan_is_named_at_its_module(tmp_path, watch):
    """Amplify's outputs are up to 3e38 (finite; tanh of them is 1, Shrink brings them back): a float32 sum of
    them is Inf, which named Amplify as the NaN's origin (full watch: a false NaN in a clean run too). The
    origin is the module whose output holds the NaN (Poison, "5"), on its rank and step; the clean twin
    has no finding in either watch."""
    spawn_ranks(_large, 2, tmp=tmp_path / "clean", watch=watch)
    assert findings(tmp_path / "clean", 0) == [] and findings(tmp_path / "clean", 1) == []
    spawn_ranks(_large, 2, tmp=tmp_path / "nan", watch=watch, poison_rank=1)
    f = findings(tmp_path / "nan", 1)[0]
    assert (f["severity"], f["step"], f["ranks"], f["subject"]) == ("error", 3, [1], "5")
    assert f["evidence"]["first_nonfinite_module_output"] == "5" and "started on rank 1 at step 3" in f["message"]
    assert "through all-reduce" in findings(tmp_path / "nan", 0)[0]["message"]


def _overflowing_batch(rank, world, tmp, big_rank=None):
    """bf16 autocast and a GradScaler (FACTS.md): one rank's batch of finite values near 3e38 at step 3. The
    first Linear's output overflows bf16 (Inf): that Linear is where the non-finite values start, not the
    model's input (finite, though its float32 sum is Inf); the scaler skips the step and the finding says so."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distdebug.config import NanOriginConfig

    s = start_session(tmp, rank, detectors=[NanOrigin(NanOriginConfig(watch="full"))])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for step in range(1, 6):
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        if rank == big_rank and step == 3:
            x = x.sign() * 3e38  # finite float32 values; in bf16 (autocast) too
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ddp(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)
    return bool(torch.isfinite(x).all())


def test_a_finite_batch_near_the_maximum_is_not_the_origin_the_overflowing_module_is(tmp_path):
    assert spawn_ranks(_overflowing_batch, 2, tmp=tmp_path / "clean") == [True, True]
    assert findings(tmp_path / "clean", 0) == [] and findings(tmp_path / "clean", 1) == []
    assert spawn_ranks(_overflowing_batch, 2, tmp=tmp_path / "big", big_rank=0) == [True, True]
    f = findings(tmp_path / "big", 0)[0]
    assert (f["severity"], f["step"], f["ranks"], f["subject"]) == ("error", 3, [0], "0")
    assert "first non-finite module output in forward order: 0" in f["message"]
    assert "(input of" not in f["message"]
    assert f["evidence"]["loss_scaler_skipped_step"] is True and "the loss scaler skipped this step" in f["message"]
    assert findings(tmp_path / "big", 1) == []  # its forward was finite: the scaler skipping is not a NaN of its own


# ---------------------------------------------------------------- parameters that were never finite
class Block(nn.Module):
    """A block whose parameter has no reset_parameters() of its own (the FSDP2 example's shape: to_empty(),
    then an init that reaches only the torch.nn modules)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(8))

    def forward(self, x):
        return x * self.w


def _never(rank, world, tmp, case, clean=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = start_session(tmp, rank, detectors=[NanOrigin()])
    torch.manual_seed(0)
    if case == "to_empty":
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 8), Block(), nn.BatchNorm1d(8), nn.Linear(8, 1))
        model.to_empty(device="cpu")
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()  # the Linears and the BatchNorm; not Block
        with torch.no_grad():
            # what to_empty() left in Block.w: uninitialised memory, which may hold anything; NaN here so that
            # the test does not depend on the allocator (the clean twin initialises it)
            model[1].w.fill_(1.0 if clean else float("nan"))
    else:
        model = nn.Sequential(nn.Linear(4, 8), Block(), nn.BatchNorm1d(8), nn.Linear(8, 1))
        with torch.no_grad():
            model[1].w.fill_(1.0)
    # a buffer that holds an infinity by design (an attention mask): never a finding
    model.register_buffer("mask", torch.full((2,), float("-inf")))
    # broadcast_buffers=False: rank 1's own running_var stays its own (DDP would overwrite it with rank 0's at
    # every forward, and the re-check on the rare path would then rightly find it finite)
    ddp = DDP(model, broadcast_buffers=case != "buffer")
    if case == "partial":  # strict=False: the checkpoint lacks Block.w, left as it was (NaN: uninitialised)
        with torch.no_grad():
            model[1].w.fill_(float("nan"))
        model.load_state_dict({k: v for k, v in model.state_dict().items() if k != "1.w"}, strict=False)
        if clean:  # the script initialises what the checkpoint did not hold, after the load
            with torch.no_grad():
                model[1].w.fill_(1.0)
    if case in ("checkpoint", "buffer"):  # each rank resumes from its own file; rank 1's holds a NaN
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if rank == 1 and not clean:
            state["0.weight" if case == "checkpoint" else "2.running_var"][0] = float("nan")
        torch.save(state, tmp / f"ckpt-{rank}.pt")
        model.load_state_dict(torch.load(tmp / f"ckpt-{rank}.pt"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    losses = []
    for step in range(1, 5):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    dist.destroy_process_group()
    s.close(0)
    return all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("case", ["to_empty", pytest.param("checkpoint", marks=pytest.mark.slow),
                                  pytest.param("buffer", marks=pytest.mark.slow),
                                  pytest.param("partial", marks=pytest.mark.slow)])
def test_parameters_that_were_never_finite_are_named_with_their_cause_on_each_rank(tmp_path, case):
    """Non-finite before the first forward (to_empty() and an init that missed a block: the upstream FSDP2
    example) or right after a load (a checkpoint holding NaN in a weight, or in BatchNorm's running_var, which
    a training forward never uses: the loss stays finite and nothing else would say it): named as such, on
    each rank where it is true, with the tensors and the likely cause; not as step 1's NaN loss of an op or a
    batch. Clean twins (every tensor initialised, a finite checkpoint): no finding."""
    assert spawn_ranks(_never, 2, tmp=tmp_path / "clean", case=case, clean=True) == [True, True]
    assert findings(tmp_path / "clean", 0) == [] and findings(tmp_path / "clean", 1) == []
    finite = spawn_ranks(_never, 2, tmp=tmp_path / "bad", case=case)
    # DDP broadcast rank 0's uninitialised block to rank 1; the partial load runs on every rank
    ranks = [0, 1] if case in ("to_empty", "partial") else [1]
    for rank in ranks:
        f = findings(tmp_path / "bad", rank)[0]
        subject = {"to_empty": "1.w", "checkpoint": "0.weight", "buffer": "2.running_var", "partial": "1.w"}[case]
        assert (f["severity"], f["step"], f["ranks"], f["subject"]) == ("error", 1, [rank], subject)
        assert f["evidence"]["nonfinite_state"] == [subject]
        assert "before any training step changed them" in f["message"]
        if case == "to_empty":
            assert f["evidence"]["checked"] == "before its first step (as built, initialised or loaded)"
            assert f["evidence"]["to_empty_at"].startswith("test_nan_origin.py:")
            assert "uninitialised memory: to_empty() at test_nan_origin.py:" in f["evidence"]["likely_cause"]
        else:
            assert f["evidence"]["loaded_at"].startswith("test_nan_origin.py:")
            assert "right after load_state_dict at test_nan_origin.py:" in f["message"]
            cause = "not in the checkpoint loaded at" if case == "partial" else "the checkpoint loaded at"
            assert cause in f["evidence"]["likely_cause"]
    if case == "buffer":  # nothing else could see it: the training itself stayed finite
        assert finite == [True, True] and findings(tmp_path / "bad", 0) == []
    if case == "checkpoint":  # rank 0 received it through the all-reduce, and says so
        assert "through all-reduce" in findings(tmp_path / "bad", 0)[0]["message"]


def _fsdp_to_empty(rank, world, tmp):
    """The upstream FSDP2 example's shape: built on the meta device, fully_shard, to_empty(), then an init
    that reaches the torch.nn modules only. Block.w is sharded: rank 1's half holds what uninitialised
    memory may hold (NaN here, so that the test does not depend on the allocator), rank 0's half is finite."""
    from torch.distributed.fsdp import fully_shard

    s = start_session(tmp, rank, detectors=[NanOrigin()])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), Block(), nn.Linear(8, 1))
    fully_shard(model)
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    with torch.no_grad():
        model[1].w.to_local().fill_(float("nan") if rank == 1 else 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


@pytest.mark.slow  # a shape of the family: full suite only
def test_fsdp2_shards_that_were_never_finite_are_named_on_the_rank_holding_them(tmp_path):
    spawn_ranks(_fsdp_to_empty, 2, tmp=tmp_path, timeout=120)
    (f,) = [f for f in findings(tmp_path, 1) if f["severity"] != "info"]
    assert (f["severity"], f["step"], f["ranks"], f["subject"]) == ("error", 1, [1], "1.w")
    assert f["evidence"]["checked"] == "before its first step (as built, initialised or loaded)"
    assert "to_empty() at" in f["evidence"]["likely_cause"]
    # rank 0's shard was finite: it received the NaN through the all-gather, and is not called an origin
    (g,) = [f for f in findings(tmp_path, 0) if f["severity"] != "info"]
    assert g["step"] == 1 and "nonfinite_state" not in g["evidence"] and g["evidence"]["origin"] != "this rank"


def test_state_checks_pass_over_lazy_empty_and_integer_tensors_and_an_empty_output_is_finite():
    """A Lazy module's parameters before its first forward, an empty tensor, an integer buffer: nothing to
    check and nothing raised (an exception would switch the detector off); an empty module output (an expert
    that got no tokens) reads finite."""
    from distdebug.detectors.nan_origin import finite_flag

    model = nn.Sequential(nn.LazyLinear(3), nn.Linear(0, 2))
    model.register_buffer("count", torch.zeros(2, dtype=torch.long))
    det = NanOrigin()
    det._check_state(model, "before its first forward", "")
    ((check),) = det._state
    assert check.names == ["1.bias"] and torch.isfinite(check.flags).all()
    assert float(finite_flag(torch.empty(0, 4))) == 0.0 and float(finite_flag(torch.empty(0, device="cpu"))) == 0.0
