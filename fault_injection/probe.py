"""What a user's script really has, learned from one clean run: the replay's probe.

``distdebug faults replay SCRIPT`` first runs the script once under attach with this probe injected
(it changes nothing: every patch calls straight through) and with every default detector on, so the
same run is the clean cell. The probe watches the very points the faults act through (a DataLoader
iterator's ``__next__``, ``DistributedSampler.__init__``, ``torch.load`` / ``torch.save`` of a path,
``torch.manual_seed``) and, once the models are known, the parameter and module a fault would aim at
by default. It writes one ``probe`` record per fact and rank, the first time it sees it.

``Facts.load`` folds those records with the run's own (discovery: wrappers, BatchNorm, optimizers,
the layout; steps: how many, with a loss or not; start: world size and backend) into what
``Fault.applicable`` and ``Fault.fit`` decide from: which faults can act on this script, and when
and where (the step chosen from the number of steps the script runs, the target from the model).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from distdebug import envvars
from distdebug.context import RankContext

from .base import Fault
from .sandbox import before_save


class Probe(Fault):
    name = "probe"
    description = "the replay's clean run: records what the script has (acts on nothing)"
    params = ()
    catcher = ""

    dataset: Any = None
    """The dataset of the first sharded DataLoader iterated with gradients on (a training loop's; else the first
    sharded, else the first) iterated."""
    sharded = False
    chosen: tuple[bool, bool] = (False, False)
    rng = ""
    """Digest of the torch random state when that DataLoader was first iterated."""

    def setup(self, ctx: RankContext) -> None:
        super().setup(ctx)
        self.seen: set[str] = set()
        import torch
        from torch.utils.data.dataloader import _BaseDataLoaderIter
        from torch.utils.data.distributed import DistributedSampler

        from distdebug.detectors.checkpoint_roundtrip import target

        probe = self
        next_, init = _BaseDataLoaderIter.__next__, DistributedSampler.__init__
        load, save, seed = torch.load, torch.save, torch.manual_seed

        def loader(it: Any) -> None:
            sampler = getattr(it, "_index_sampler", None)
            inner = getattr(sampler, "sampler", sampler)
            sharded = isinstance(inner, DistributedSampler) or type(sampler).__name__ == "BatchSamplerShard"
            probe.fact("dataloader", sampler=type(inner).__name__, distributed=sharded)  # accelerate's sharding
            rank = (sharded, torch.is_grad_enabled())  # a sharded loader iterated for training wins
            if probe.dataset is None or rank > probe.chosen:
                # The dataset duplicate_data would hand every rank the same indices of: read again at the end;
                # and the random state its batches started from (each rank's own, or the same on every rank).
                probe.dataset, probe.sharded, probe.chosen = getattr(it, "_dataset", None), sharded, rank
                probe.rng = _digest(torch.random.get_rng_state())

        def path(f: Any) -> str | None:
            where = target(f)  # a path, or a file object opened on one; None: a buffer
            return os.path.abspath(where) if where is not None else None

        def loaded(f: Any, obj: Any) -> None:
            if _has_float(obj):
                where, names = path(f), _names(obj)
                probe.fact("load", key=f"{where}:{names}", path=where, names=names)

        # Whether each path existed before this rank first saved to it; on the replay's clean run, the file
        # that was there is kept (fault_injection.sandbox), so that the replay puts a path outside its copy of
        # the working directory back between runs.
        backups = envvars.get(envvars.REPLAY_BACKUP)
        existed: dict[str, bool | None] = {}

        def before(f: Any) -> None:
            where = path(f)
            if where is not None and where not in existed:
                existed[where] = None  # once per path, even if what follows fails
                existed[where] = before_save(where, backups, opened=not isinstance(f, (str, os.PathLike)))

        # An atomic save (torch.save(obj, tmp); os.replace(tmp, ckpt)) overwrites ckpt by the rename: kept too.
        # Only the renames of a file torch.save wrote: a compiler's cache or a download moved into place is not
        # the script's state, and putting it back (removing it) between runs would only cost.
        written: set[str] = set()

        def moved(src: Any, dst: Any) -> None:
            if backups and os.path.realpath(os.fspath(src)) in written:
                before_save(os.path.abspath(os.fspath(dst)), backups)

        def saved(f: Any, obj: Any) -> None:
            where, names = path(f), _names(obj)
            if backups and where is not None:
                written.add(os.path.realpath(where))
            if where is not None or hasattr(f, "write"):  # a buffer's save is known by its tensors' names
                probe.fact("save", key=f"{where}:{names}", path=where, names=names, existed=existed.get(where or ""))

        # Every observation is quiet (an exception of ours never reaches the script) and calls straight through.
        def __next__(it: Any) -> Any:
            if "dataloader:" not in probe.seen or probe.chosen != (True, True):
                _quietly(loader, it)
            return next_(it)

        def sampler_init(sampler: Any, *args: Any, **kwargs: Any) -> None:
            init(sampler, *args, **kwargs)
            _quietly(probe.fact, "distributed_sampler")

        def load_(f: Any, *args: Any, **kwargs: Any) -> Any:
            obj = load(f, *args, **kwargs)
            _quietly(loaded, f, obj)
            return obj

        def save_(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            _quietly(before, f)
            out = save(obj, f, *args, **kwargs)
            _quietly(saved, f, obj)
            return out

        def manual_seed(s: Any) -> Any:
            _quietly(probe.fact, "manual_seed")
            return seed(s)

        def renamer(original: Any) -> Any:
            def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
                if not args and not kwargs:  # paths relative to directory descriptors: not followed
                    _quietly(moved, src, dst)
                return original(src, dst, *args, **kwargs)

            return rename

        ctx.patch(_BaseDataLoaderIter, "__next__", __next__)
        ctx.patch(DistributedSampler, "__init__", sampler_init)
        ctx.patch(torch, "load", load_)
        ctx.patch(torch, "save", save_)
        if backups:  # the replay's clean run only
            ctx.patch(os, "replace", renamer(os.replace))
            ctx.patch(os, "rename", renamer(os.rename))
        ctx.patch(torch, "manual_seed", manual_seed)
        ctx.patch(torch.random, "manual_seed", manual_seed)

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        from . import _targets

        param = _targets.parameter(ctx, "")
        module = _targets.module(ctx, "")
        replicas: Any = "every rank"  # the ranks that hold the same values of the parameter (Layout.replicas)
        layout = getattr(ctx, "layout", None)
        if param is not None and layout is not None:
            group = layout.replicas(param[1])
            replicas = "every rank" if group is None else (group or [])
        self.fact("targets", param=param[0] if param else None, module=module[0] if module else None,
                  param_replicas=replicas)

    def on_end(self) -> tuple[()]:
        """After the training: the probed dataset's first sample read twice (the random state put back), so
        that the replay knows whether ranks given the same indices would see the same batch."""
        if self.dataset is not None:
            _quietly(self._sample_digest)
        return ()

    def _sample_digest(self) -> None:
        """Read the first sample three times from fixed random states (0, 0, 1; the states put back after):
        whether it reads the same from the same state (``repeatable``), and whether it depends on the random
        state at all (``random``: an augmentation drawn from the global generators)."""
        import random

        import torch

        ds = self.dataset
        if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")) or len(ds) == 0:
            return  # an IterableDataset: no index to read again
        np = _numpy()
        states: list[Any] = [torch.random.get_rng_state(), random.getstate(),
                             np.random.get_state() if np is not None else None]

        def read(seed: int) -> str:
            torch.default_generator.manual_seed(seed)  # not the patched torch.manual_seed: no fact of the script's
            random.seed(seed)
            if np is not None:
                np.random.seed(seed)
            return _digest(ds[0])

        try:
            first, again, other = read(0), read(0), read(1)
        finally:
            torch.random.set_rng_state(states[0])
            random.setstate(states[1])
            if np is not None:
                np.random.set_state(states[2])
        self.fact("dataset_sample", digest=first, repeatable=first == again, random=first != other, rng=self.rng,
                  sharded=self.sharded)

    def fact(self, what: str, key: str = "", **details: Any) -> None:
        """One record per fact (and key: each saved path) and rank."""
        tag = f"{what}:{key}"
        if tag in self.seen or self.ctx is None or self.ctx.emit is None:
            return
        self.seen.add(tag)
        self.ctx.emit("probe", fact=what, step=self.current, **details)


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the probe only watches: its failure must not reach the script
        pass


def _numpy() -> Any:
    import sys

    return sys.modules.get("numpy")


def _digest(obj: Any) -> str:
    """A digest of a sample's values (tensors, arrays, numbers, strings, nested in dicts, lists and tuples):
    equal for equal samples; other objects count by their type only."""
    import hashlib

    import torch

    h = hashlib.sha1()

    def walk(x: Any, depth: int) -> None:
        if depth > 8:
            return
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(f"K{k}".encode())
                walk(x[k], depth + 1)
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}".encode())
            for v in x:
                walk(v, depth + 1)
        elif isinstance(x, (int, float, str, bytes, bool)) or x is None:
            h.update(repr(x).encode())
        elif hasattr(x, "tobytes"):  # a numpy array or a PIL image
            h.update(bytes(x.tobytes()))
        else:
            h.update(type(x).__qualname__.encode())

    walk(obj, 0)
    return h.hexdigest()[:16]


def _names(obj: Any) -> str:
    """The tensors' key paths of a saved or loaded object, hashed: a save into a buffer (Lightning's,
    written through fsspec) is matched to its load by them, as checkpoint_roundtrip matches it."""
    import hashlib

    from distdebug.detectors.checkpoint_roundtrip import tensor_items

    return hashlib.sha1("\n".join(name for name, _ in tensor_items(obj)).encode()).hexdigest()[:16]


def _has_float(obj: Any, depth: int = 0) -> bool:
    """Whether a loaded object holds a floating-point tensor (what checkpoint_corruption alters)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point()
    if depth > 6:
        return False
    if isinstance(obj, dict):
        return any(_has_float(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_float(v, depth + 1) for v in obj)
    return False


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
            done = [r["step"] for r in records if r.get("kind") == "step" and isinstance(r.get("step"), int)]
            steps.append(max(done, default=0))
            for r in records:
                kind = r.get("kind")
                if kind == "start":
                    f.world = max(f.world, int(r.get("world_size") or 0))
                elif kind == "end" and rank == 0:
                    f.exit_code = r.get("exit_code")
                elif kind == "step":
                    loss = r.get("loss")
                    if loss is not None:
                        f.loss = True
                        f.loss_ranks.add(rank)
                        if isinstance(loss, (int, float)) and math.isfinite(loss):
                            lo, hi = f.losses.get(rank, (loss, loss))
                            f.losses[rank] = (min(lo, loss), max(hi, loss))
                    f.collectives = f.collectives or bool(r.get("collectives"))
                elif kind == "discovery":
                    f._discovery(r)
                elif kind == "probe":
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
