"""What the probe run showed about a script (``Facts``): pure data, read by every fault's ``applicable`` and
``fit`` and built by ``Facts.load`` from the probe run's records (``fault_injection.probe`` writes them). Its own
module: the faults' base reads it and the probe is a fault, so with it inside probe.py the two imported each
other."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from distdebug.artifacts import schema


@dataclass(frozen=True)
class Sample:
    """A rank's dataset's first sample, read after the clean run from fixed random states."""

    digest: str
    repeatable: bool
    """Read twice from the same random state: the same."""
    random: bool = False
    """Read from another random state: different (an augmentation drawn from the global generators)."""
    rng: str = ""
    """Digest of the rank's torch random state when the training's DataLoader was first iterated."""


@dataclass
class Facts:
    """What the probe run showed about the script (pure data; built by ``load``, or by hand in tests)."""

    steps: int = 0
    """Optimizer steps every rank finished."""
    world: int = 0
    backend: str = ""
    exit_code: int | None = None
    wrappers: set[str] = field(default_factory=set)
    """Wrappers of the discovered models: ddp, fsdp2, deepspeed; manual (a loop that all-reduces its gradients
    itself) or plain (no wrapper, no gradient all-reduce seen)."""
    replicas: int = 0
    """Ranks holding the same parameters (the data-parallel group's size; 0: unknown)."""
    zero_stage: int | None = None
    """DeepSpeed's ZeRO stage (None: no DeepSpeed engine)."""
    batchnorm: int = 0
    syncbatchnorm: int = 0
    broadcast_buffers: bool | None = None
    optimizers: int = 0
    loss: bool = False
    """The steps carried a loss the harness could read."""
    loss_ranks: set[int] = field(default_factory=set)
    """The ranks whose steps carried a loss (a pipeline's last stage only)."""
    pipeline: bool = False
    """Pipeline stages that exchange activations by send/recv (a rank can wait for another without a collective)."""
    tensor_parallel: bool = False
    """Layers split across ranks (DTensor meshes, TP plans, model parallelism by hand): they communicate inside
    the forward and backward."""
    collectives: bool = False
    dataloader: bool = False
    distributed_sampler: bool = False
    manual_seed: bool = False
    """torch.manual_seed was called before the first step ended (before the model was known)."""
    loads: dict[int, list[str]] = field(default_factory=dict)
    """Rank -> paths it restored tensors from that a rank of this run saved (checked by checkpoint_roundtrip)."""
    losses: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Rank -> (lowest, highest) finite loss of its steps."""
    param_replicas: dict[int, Any] = field(default_factory=dict)
    """Rank -> the ranks holding the same values of its default parameter: "every rank", a list of ranks, or []
    (nobody else: a shard of its own, FSDP2's full shard)."""
    samples: dict[int, Sample] = field(default_factory=dict)
    """Rank -> its dataset's first sample, read after the clean run (``Probe._sample_digest``)."""
    targets: dict[int, tuple[str | None, str | None]] = field(default_factory=dict)
    """Rank -> (the parameter a fault aims at by default, the last weight; the module a NaN is planted in by
    default, one that can make a NaN of finite numbers): per rank, as a pipeline's stages hold other modules."""

    @property
    def hand_written(self) -> bool:
        """Every model is trained without a data-parallel wrapper."""
        return bool(self.wrappers) and self.wrappers <= {"manual", "plain"}

    def aim(self, which: int) -> tuple[int, str] | None:
        """(rank, name) of the default parameter (``which`` 0) or module (1): on rank 1, where faults act by
        default, else on the first rank that has one (a pipeline stage holding a single layer has no inner
        module to plant a NaN in)."""
        for rank in sorted(self.targets, key=lambda r: (r != 1, r)):
            name = self.targets[rank][which]
            if name:
                return rank, name
        return None

    @property
    def param(self) -> str | None:
        found = self.aim(0)
        return found[1] if found else None

    @property
    def module(self) -> str | None:
        found = self.aim(1)
        return found[1] if found else None

    def constant_loss(self) -> float | None:
        """The loss's one value when every rank's steps had the same finite loss throughout (a loss that does
        not move with the model: cross-entropy over a single output column is 0 whatever the weights), else
        None."""
        ranges = list(self.losses.values())
        if not ranges or any(lo != hi for lo, hi in ranges) or len({lo for lo, _ in ranges}) > 1:
            return None
        return ranges[0][0]

    def unshareable_samples(self) -> str:
        """Why ranks handed the same indices would still see different batches ('' when they would, or when
        unknown): a dataset that reads differently each time (random samples, random augmentation), or
        datasets that differ between ranks at the same index (unseeded random data, each rank's own files)."""
        samples = list(self.samples.values())
        if not samples:
            return ""
        if not all(s.repeatable for s in samples):
            return ("its dataset returns a different sample each time the same index is read, even from the same "
                    "random state (randomness of its own: the time, os.urandom, another process): ranks given the "
                    "same indices would still see different batches")
        if len({s.digest for s in samples}) > 1:
            return ("the ranks' datasets hold different samples at the same index (built from random numbers "
                    "without a seed, or from each rank's own files): ranks given the same indices would still "
                    "see different batches")
        if any(s.random for s in samples) and all(s.rng for s in samples) and len({s.rng for s in samples}) > 1:
            return ("its samples are drawn with random numbers (an augmentation) from each rank's own random state "
                    "(the ranks' states differed when the training's DataLoader started): ranks given the same "
                    "indices would still see different batches")
        return ""

    def replicas_of_param(self) -> str:
        """Why the default parameter has no replica to compare with on the rank a fault aims at ('' when it has,
        or when unknown)."""
        found = self.aim(0)
        if found is None:
            return ""
        rank, name = found
        group = self.param_replicas.get(rank, "every rank")
        if group == [] or group is False:
            return f"no other rank holds the values of {name} (each rank holds a shard of its own)"
        return ""

    @property
    def wrapper_names(self) -> str:
        return ", ".join(sorted(self.wrappers)) or "no model"

    @classmethod
    def load(cls, run: Any) -> Facts:
        """From a loaded run directory (``distdebug.artifacts.reader.Run``) of the probe run."""
        f = cls()
        saved: set[str] = set()
        loads: dict[int, list[tuple[str | None, str | None]]] = {}
        steps: list[int] = []
        for rank, stream in run.ranks.items():
            records = stream.last_attempt()
            done = [r["step"] for r in records if r.get("kind") == schema.STEP and isinstance(r.get("step"), int)]
            steps.append(max(done, default=0))
            for r in records:
                kind = r.get("kind")
                if kind == schema.START:
                    f.world = max(f.world, int(r.get("world_size") or 0))
                elif kind == schema.END and rank == 0:
                    f.exit_code = r.get("exit_code")
                elif kind == schema.STEP:
                    loss = r.get("loss")
                    if loss is not None:
                        f.loss = True
                        f.loss_ranks.add(rank)
                        if isinstance(loss, (int, float)) and math.isfinite(loss):
                            lo, hi = f.losses.get(rank, (loss, loss))
                            f.losses[rank] = (min(lo, loss), max(hi, loss))
                    f.collectives = f.collectives or bool(r.get("collectives"))
                elif kind == schema.DISCOVERY:
                    f._discovery(r)
                elif kind == schema.PROBE:
                    what = r.get("fact")
                    if what == "dataloader":
                        f.dataloader = True
                        f.distributed_sampler = f.distributed_sampler or bool(r.get("distributed"))
                    elif what == "distributed_sampler":
                        f.distributed_sampler = True
                    elif what == "manual_seed" and r.get("step") == 1:
                        f.manual_seed = True
                    elif what == "save":
                        saved.add(r.get("path") or f"names:{r.get('names')}")
                    elif what == "load":
                        loads.setdefault(rank, []).append((r.get("path"), r.get("names")))
                    elif what == "targets":
                        f.targets[rank] = (r.get("param"), r.get("module"))
                        if r.get("param") is not None and "param_replicas" in r:
                            f.param_replicas[rank] = r.get("param_replicas")
                    elif what == "dataset_sample":
                        f.samples[rank] = Sample(str(r.get("digest")), bool(r.get("repeatable")),
                                                 bool(r.get("random")), str(r.get("rng") or ""))
        f.steps = min(steps, default=0)
        # A restore of a path a rank saved, or of what a rank saved into a buffer (the same tensors' names).
        f.loads = {rank: [p or "a buffer" for p, names in paths if p in saved or f"names:{names}" in saved]
                   for rank, paths in loads.items()}
        f.loads = {rank: paths for rank, paths in f.loads.items() if paths}
        return f

    def _discovery(self, r: dict[str, Any]) -> None:
        for m in r.get("models") or []:
            chain = [w for w in m.get("wrappers") or [] if w != "torch.compile"]
            self.wrappers.update(chain or [m.get("wrapper") or "plain"])
            self.batchnorm = max(self.batchnorm, int(m.get("batchnorm_modules") or 0))
            self.syncbatchnorm = max(self.syncbatchnorm, int(m.get("syncbatchnorm_modules") or 0))
            zero = ((m.get("options") or {}).get("deepspeed") or {}).get("zero_stage")
            if zero is not None:
                self.zero_stage = max(self.zero_stage or 0, int(zero))
            ddp = (m.get("options") or {}).get("ddp")
            if ddp is not None:
                self.broadcast_buffers = bool(ddp.get("broadcast_buffers", True))
        self.optimizers = max(self.optimizers, len(r.get("optimizers") or []))
        layout = r.get("layout") or {}
        self.pipeline = self.pipeline or bool(layout.get("pipeline"))
        self.tensor_parallel = self.tensor_parallel or any(
            layout.get(k) for k in ("tensor_parallel", "meshes", "model_parallel_by_hand"))
        group = layout.get("data_parallel_group") or []
        self.replicas = max(self.replicas, len(group))
        pg = r.get("process_group") or {}
        self.backend = self.backend or str(pg.get("backend") or "")
