"""Likely cause, quick check and fix for each finding: a practitioners' symptom table as a knowledge base.

The table maps what a practitioner sees to its usual cause:

==========================================  ============================================
loss suddenly x10 / NaN                     failed gradient sync, non-finite gradients
utilisation under 50 %                      communication blocking, data loading
ranks' losses differ                        BatchNorm statistics not synced, seeds not fixed
OOM in forward, not backward                activations
loss jumps after restoring a checkpoint     shards restored wrongly
==========================================  ============================================

A detector already knows more than the symptom (which rank, which tensor), so its own ``fix``
stays first; this table adds the *why* and what to look at next, as PyTorch behaves (after DDP's
all-reduce every rank holds the averaged gradient, so clip_grad_norm_ needs no sqrt(world)
rescaling; with TORCH_NCCL_ASYNC_ERROR_HANDLING=0 a failed NCCL collective hangs instead of
ending the job). Pure functions: no torch, no rich.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from distdebug.findings import Finding

LOSS_X10 = "loss suddenly x10 or NaN"
SLOW = "GPU utilisation stuck under 50 %, slow steps"
LOSSES_DIFFER = "ranks' losses or weights differ"
OOM_FORWARD = "out of memory in forward, not backward"
RESTORE = "loss jumps after restoring a checkpoint"
HANG = "job stuck until the collective timeout"
ENVIRONMENT = "job fails to start, or runs slow, on some nodes only"
CONFIG = "a configuration trap (runs, but wrong or slow)"
REPRODUCE = "two runs of the same script do not match"
DISK = "a disk fills in the middle of a long job"


@dataclass(frozen=True)
class Advice:
    symptom: str
    """The symptom row this finding belongs to (what the user would have seen)."""
    cause: str
    check: str
    """What to look at next, as a command where distdebug has one."""
    fix: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _ranks(f: Finding) -> str:
    if not f.ranks:
        return "the ranks"
    return ("rank " if len(f.ranks) == 1 else "ranks ") + ", ".join(str(r) for r in f.ranks[:8]) + \
        ("..." if len(f.ranks) > 8 else "")


def advise(f: Finding, *, run_dir: str = "RUN", restored_before: int | None = None) -> Advice:
    """The advice for one finding. ``restored_before``: the step of a checkpoint-restore finding at
    or before this one, if any (a loss jump right after a restore means shards loaded wrongly)."""
    d, ev, step = f.detector, f.evidence or {}, f.step
    at = f" --step {step}" if step is not None else ""
    if d == "nan_origin" and ev.get("origin") == "another rank":
        return Advice(LOSS_X10, f"{_ranks(f)} only received the NaN/Inf: another rank's gradients were "
                      "non-finite and the all-reduce spread them", "the nan_origin finding that says 'started on'",
                      "fix the origin rank; nothing to do on this one")
    if d == "nan_origin" and ev.get("nonfinite_state"):
        return Advice(LOSS_X10, f"parameters or buffers on {_ranks(f)} were non-finite {ev.get('checked')}, before "
                      f"any step: {ev.get('likely_cause')}", "the finding's tensors (evidence: nonfinite_state)",
                      f.fix or "initialise or load finite values into the named tensors before training")
    if d == "nan_origin" and f.subject == "non-finite steps":
        return Advice(LOSS_X10, "the run never recovered: once the weights hold NaN/Inf every later step is "
                      "non-finite too", "the first nan_origin finding (where it started)",
                      "stop such runs early: distdebug attach --stop-on-nan; restart from the last good checkpoint")
    if d in ("loss_nonfinite", "nan_origin"):
        origin = "a numerically unstable op or a bad batch on " + _ranks(f) + ", spread to every rank by the " \
            "gradient all-reduce" if d == "nan_origin" else "non-finite gradients (overflow, division by zero, " \
            "log of 0) or a failed gradient sync"
        return Advice(LOSS_X10, origin,
                      "nan_origin's finding names the first module and tensor; rerun that rank with "
                      "torch.autograd.set_detect_anomaly(True) around that step for the operation",
                      "clip gradients (clip_grad_norm_ after backward: DDP already averaged them, no rescaling "
                      "by world size), lower the learning rate, check the batch and the loss for log(0)/x/0")
    if d == "loss_spike":
        if "median_of_other_ranks" in ev:
            return Advice(LOSSES_DIFFER, f"{_ranks(f)} trained on different data or state than the others: "
                          "a bad batch, BatchNorm statistics not synced, or seeds not fixed",
                          f"distdebug diff {run_dir}{at}; compare BatchNorm running_mean across ranks",
                          "SyncBatchNorm.convert_sync_batchnorm(model) before DDP; seed every rank the same "
                          "before building the model; DistributedSampler with set_epoch")
        if restored_before is not None:
            return Advice(RESTORE, f"the jump follows the checkpoint restore at step {restored_before}: "
                          "shards restored wrongly (wrong rank's file, missing optimizer state)",
                          f"distdebug report {run_dir}: checkpoint_roundtrip names the tensors that differ",
                          "load through the sharding-aware API (DCP, engine.load_checkpoint), each rank its own shard")
        return Advice(LOSS_X10, "a failed gradient sync, non-finite-adjacent gradients, a bad batch or a "
                      "learning rate too high (after a restore: shards loaded wrongly)",
                      f"distdebug diff {run_dir}{at}: do the replicas still agree?",
                      "check the clipping threshold and the learning-rate schedule; skip or inspect that batch")
    if d == "replica_divergence":
        return Advice(LOSSES_DIFFER, f"{_ranks(f)} applied a different update: a skipped or partial gradient "
                      "all-reduce, a rank-local code path, or a corrupted parameter (bit flip)",
                      f"distdebug diff {run_dir}{at} (the tensors that differ, first divergent step)",
                      "make every rank run the same collectives in the same order; no rank-dependent "
                      "branches around optimizer.step(); on a bit flip, take that GPU out of the pool")
    if d == "bn_divergence":
        return Advice(LOSSES_DIFFER, "BatchNorm statistics not synced: each rank normalises with its own "
                      "batch's statistics and keeps its own running_mean/var",
                      "compare running_mean across ranks (the finding's evidence)",
                      "SyncBatchNorm.convert_sync_batchnorm(model) before wrapping in DDP, or keep "
                      "broadcast_buffers=True")
    if d == "init_seed" and f.subject == "torch.manual_seed":
        return Advice(REPRODUCE, "torch's generator is seeded from the OS: no two runs draw alike (the replicas "
                      "are not affected)", "the seeds in the finding's evidence",
                      "torch.manual_seed(seed) (and random/numpy seeds) at the start, or distdebug attach "
                      "--deterministic")
    if d == "init_seed":
        return Advice(LOSSES_DIFFER, "seeds not fixed: ranks built different initial weights",
                      f"distdebug diff {run_dir} --step 1",
                      "torch.manual_seed(seed) on every rank before building the model (DDP and FSDP "
                      "broadcast rank 0's weights only at wrap time)")
    # Each check names what that finding's evidence holds (data_order's three findings hold different things).
    if d == "data_order" and f.subject == "DistributedSampler.set_epoch":
        return Advice(CONFIG, "an epoch trained on the same sample order as an earlier one: set_epoch(epoch) "
                      "not called before iterating the DataLoader (the order is a function of seed and epoch)",
                      "the finding's evidence: where the repeating pass and the earlier one were iterated, and the "
                      "steps each was first trained on; a set_epoch call before the loop at 'where'",
                      "sampler.set_epoch(epoch) at the start of every epoch, before the loop")
    if d == "data_order" and f.subject == "loss":
        return Advice(LOSSES_DIFFER, "the same batch gave different losses on different ranks: the replicas are "
                      "not the same model (initialisation, seeds, an unsynchronised update) or not deterministic",
                      f"the finding's evidence: each rank's loss at that step; distdebug diff {run_dir}{at}",
                      "seed every rank alike and broadcast the initial parameters (DDP does at construction)")
    if d == "data_order":
        return Advice(LOSSES_DIFFER, "ranks read the same samples: a sampler without rank/world size "
                      "(DistributedSampler missing), so each rank repeats the others' work",
                      "the finding's evidence: the steps at which every rank's batch fingerprint was the same",
                      "DistributedSampler(dataset, num_replicas=world, rank=rank) and sampler.set_epoch(epoch)")
    if d == "checkpoint_roundtrip":
        return Advice(RESTORE, "shards restored wrongly: the restore read other bytes than the save wrote "
                      "(another rank's shard, a rewritten or truncated file)",
                      "the tensor named in the finding; the checkpoint files' sizes and times",
                      "load through the sharding-aware API (DCP, engine.load_checkpoint), each rank its own shard; "
                      "write checkpoints atomically (temp file, then rename)")
    if d == "straggler":
        data = ev.get("cause") == "data loader"
        return Advice(SLOW, f"{_ranks(f)} is slow and every other rank waits for it at each collective: "
                      + ("its data loading" if data else "its compute (a slower or throttled GPU, a busy CPU, "
                                                         "uneven work)"),
                      f"distdebug attach --profile-steps A:B ... then distdebug report {run_dir}: the window's "
                      "data share and top operators on that rank",
                      "prefetch and more DataLoader workers, pin_memory" if data else
                      "check that GPU's clocks and temperature (nvidia-smi -q -d PERFORMANCE); balance the work")
    if d == "memory":
        return Advice(OOM_FORWARD, "activations, or optimizer state larger than expected",
                      "the memory column: parameters / gradients / optimizer state / activations",
                      "activation checkpointing, smaller micro-batches or shorter sequences; ZeRO/FSDP for state")
    if d == "oom":
        phase = ev.get("phase")
        return Advice(OOM_FORWARD if phase == "forward" else "out of memory",
                      "activations (forward)" if phase == "forward" else
                      "gradients and optimizer state (backward/step)" if phase in ("backward", "step") else
                      "activations or optimizer state",
                      "the memory column of the rank that failed: which part grew",
                      "activation checkpointing, shorter sequences or smaller micro-batches" if phase == "forward"
                      else "ZeRO/FSDP sharding of gradients and optimizer state, or smaller micro-batches")
    if d == "hang" and f.subject == "init_process_group":
        return Advice(ENVIRONMENT, "the environment: ranks that cannot reach each other (address, port, socket "
                      "interface) or never reach init_process_group", "distdebug doctor --nproc-per-node N",
                      f.fix or "the same MASTER_ADDR/PORT, world size and a real socket interface on every node")
    if d == "hang":
        return Advice(HANG, f"{_ranks(f) if f.ranks else 'a rank'} stopped calling collectives or called a "
                      "different one (rank-dependent branch, a rank that raised or died, mismatched sizes)",
                      f"distdebug report {run_dir}: the stalled ranks' stacks and the collective each waits in",
                      "make every rank call the same collectives with the same sizes; keep "
                      "TORCH_NCCL_ASYNC_ERROR_HANDLING on so NCCL errors end the job instead of hanging")
    if d in ("env_check", "env_diff", "link_matrix"):
        return Advice(ENVIRONMENT, "the environment (the usual cause of distributed failures): "
                      + {"env_check": "a variable with a known-dangerous value",
                         "env_diff": "nodes or ranks run with different software or variables",
                         "link_matrix": "one slow link between two ranks (cabling, PCIe path, NIC)"}[d],
                      "distdebug doctor --nproc-per-node N --bandwidth",
                      "one container image and launcher environment everywhere; fix the flagged variable or link")
    if d == "config_lint":
        return Advice(CONFIG, "a DDP/FSDP/DeepSpeed setting that wastes time or silently changes training",
                      "distdebug lint SCRIPT (the same check on the source)",
                      "follow the finding's fix")
    if d == "log_volume":
        return Advice(DISK, "output nobody sized: the script's prints into the job's output file, NCCL_DEBUG's "
                      "per-collective lines, torchrun's log folder, or a run-directory budget larger than its disk",
                      "the finding's bytes an hour per destination; df -h on the file system it names; the report's "
                      "disk: line (the prediction beside what was then written)",
                      f.fix or "write less, or somewhere with room")
    if d == "teardown":
        return Advice("job failed after the last step", "a thread still running when the interpreter exited "
                      "(gloo/NCCL workers of a process group that was not destroyed, or another library's), "
                      "or an atexit handler: the training itself completed",
                      "the finding's list of what was still alive when the script ended",
                      f.fix or "destroy_process_group() after the last collective")
    if d == "harness" and f.subject.startswith("detector:"):
        return Advice("a distdebug detector failed", "distdebug itself (the detector was switched off; "
                      "training was not affected)", "the message; rerun with DISTDEBUG_DEBUG=1",
                      "report it; meanwhile --detectors without that one")
    if d == "harness" and f.subject == "launcher":
        return Advice("the launcher process died", "the launcher was killed (the OOM killer, the scheduler, a "
                      "signal): its ranks ended themselves so that none is left behind", "dmesg; the scheduler's "
                      "log for the launcher's pid", f.fix or "restart the job; give the launcher's node more memory")
    if d == "harness":  # what the harness could not do or see (a full disk, no model found): not the training's
        return Advice("what distdebug could not do or see in this run", "the message says (the training was not "
                      "affected)", "the message", f.fix or "")
    return Advice("", "", "", f.fix or "")


NAN_FAMILY = ("loss_nonfinite", "nan_origin")
NAN_CAN_CAUSE = ("replica_divergence", "bn_divergence", "loss_spike", "loss_scale")
"""What a NaN/Inf can cause in later steps: values that became non-finite differ everywhere (replicas,
BatchNorm statistics), spike, or keep a loss scaler skipping. Not inputs, seeds, configuration,
checkpoints, hangs or speed: those findings keep their own cause after a NaN."""


def advise_all(findings: list[Finding], *, run_dir: str = "RUN") -> list[Advice]:
    """Advice for each finding, in order, with the context the table needs: a loss jump after a
    checkpoint restore means shards restored wrongly; anything after the first NaN (BatchNorm
    statistics, replicas, spikes all turn non-finite with it) is most likely its consequence."""
    restores = sorted(f.step for f in findings if f.detector == "checkpoint_roundtrip" and f.step is not None)
    nans = [f.step for f in findings if f.detector in NAN_FAMILY and f.step is not None and f.severity != "info"]
    first_nan = min(nans) if nans else None
    divergences = [f.step for f in findings if f.detector == "replica_divergence" and f.step is not None]
    first_divergence = min(divergences) if divergences else None
    out = []
    for f in findings:
        before = [s for s in restores if f.step is not None and s <= f.step]
        a = advise(f, run_dir=run_dir, restored_before=before[-1] if before else None)
        if f.detector == "init_seed" and f.subject != "torch.manual_seed" and restores:
            a = Advice(a.symptom, "the ranks restored different values from a checkpoint before the first step (see "
                       "the checkpoint_roundtrip finding), not their seeds", "the checkpoint_roundtrip finding's "
                       "tensor and files", "load through the sharding-aware API, each rank its own shard")
        if first_divergence is not None and f.detector in ("bn_divergence", "loss_spike") and f.step is not None \
                and f.step > first_divergence:
            a = Advice(a.symptom, f"probably a consequence of the replica divergence from step {first_divergence} "
                       f"(replicas that differ compute different statistics and losses); otherwise: {a.cause}",
                       a.check, "fix the divergence first (its finding says how the replicas parted)")
        # In the NaN's own step only a replica divergence can follow from it: where ranks are not all
        # reduced alike (tensor-parallel peers' replicated tensors, stages), the rank holding the NaN
        # parts from the others in that same update.
        if first_nan is not None and f.detector in NAN_CAN_CAUSE and f.step is not None and (
                f.step > first_nan or (f.step == first_nan and f.detector == "replica_divergence")):
            a = Advice(a.symptom, f"probably a consequence of the NaN/Inf from step {first_nan} (values that "
                       f"became non-finite differ everywhere); otherwise: {a.cause}", a.check, a.fix)
        out.append(a)
    return out


def findings_with_advice(findings: list[Finding], *, run_dir: str = "RUN") -> list[dict[str, Any]]:
    """Each finding as a dict with its ``advice`` (what ``report --json`` and ``--html`` show)."""
    advice = advise_all(findings, run_dir=run_dir)
    return [{**f.to_dict(), "advice": a.to_dict()} for f, a in zip(findings, advice, strict=True)]


def incidents_with_advice(incidents: list[Any], findings: list[Finding], *,
                          run_dir: str = "RUN") -> list[dict[str, Any]]:
    """Each incident (analysis.incidents) as a dict: its severity, title, the fix (the root's own, else its
    advice's), the root and its members as findings with their advice (computed over all the run's findings,
    so that the context the table uses, such as an earlier NaN, is there)."""
    advice = {id(f): a for f, a in zip(findings, advise_all(findings, run_dir=run_dir), strict=True)}
    out = []
    for inc in incidents:
        def one(f: Finding) -> dict[str, Any]:
            a = advice.get(id(f)) or advise(f, run_dir=run_dir)
            return {**f.to_dict(), "advice": a.to_dict()}

        root = one(inc.root)
        out.append({"severity": inc.severity.value, "title": inc.title,
                    "fix": inc.root.fix or root["advice"]["fix"], "root": root,
                    "members": [one(m) for m in inc.members]})
    return out
