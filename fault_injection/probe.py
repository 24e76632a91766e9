"""What a user's script really has, learned from one clean run: the replay's probe.

``distdebug faults replay SCRIPT`` first runs the script once under attach with this probe injected
(it changes nothing: every patch calls straight through) and with every default detector on, so the
same run is the clean cell. The probe watches the very points the faults act through (a DataLoader
iterator's ``__next__``, ``DistributedSampler.__init__``, ``torch.load`` / ``torch.save`` of a path,
``torch.manual_seed``) and, once the models are known, the parameter and module a fault would aim at
by default. It writes one ``probe`` record per fact and rank, the first time it sees it.

``Facts.load`` (``fault_injection.facts``) folds those records with the run's own (discovery: wrappers,
BatchNorm, optimizers, the layout; steps: how many, with a loss or not; start: world size and backend) into what
``Fault.applicable`` and ``Fault.fit`` decide from: which faults can act on this script, and when
and where (the step chosen from the number of steps the script runs, the target from the model).
"""

from __future__ import annotations

import os
from typing import Any

from distdebug import envvars
from distdebug.artifacts import schema
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
        self.ctx.emit(schema.PROBE, fact=what, step=self.current, **details)


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
