"""ParityRecorder (``attach --parity``): what ``distdebug parity`` compares between two runs of one training.

A recorder, not a detector: it finds nothing in its own run. At the chosen steps (``steps``: the first eight,
then each power of two: where a departure starts, and how rounding grows after) it records, at the step
boundary (after the optimizer's step, before the script zeroes the gradients), for every parameter of the
model discovery found (by its name inside the wrappers: a DDP run's and a plain run's names agree):

- the gradient's and the parameter's sketch (``fingerprint.sketch``: 128 float64 numbers each, linear, so that
  two runs' distance is the distance of their sketches) and their float64 sums of squares;
- the rank's loss and the gradients' global norm (the norm of every gradient together);
- each floating buffer's sketch (BatchNorm's running statistics: per-rank statistics depart from the whole
  batch's), and every dtype: the parameters', the buffers', the optimizer state's (AdamW's moments kept in
  bfloat16 where the reference keeps float32);
- the optimizer's hyperparameters (each parameter group's numbers: a learning rate scaled by the world size);
- on every rank, each replicated gradient's sum of squares (a gradient some rank never reduced disagrees
  across the ranks);
- a fingerprint of the step's data: over every training forward of the outermost module in the step, the sum
  over the batch's samples of ``sin(sample @ P)`` (a sample's first WIDTH numbers; P: 8 fixed directions,
  float64, built on the device: ``_directions``), and the number of samples. It does not depend on how the
  samples are split between the ranks or micro-batches, or on their order: summed over the ranks it is the
  reference's exactly when the ranks together saw the same samples.

At every step each rank also records its part of the gradients' global norm, the norms it clipped by
(``clip_grad_norm_``'s, ``clip_grads_with_norm_``'s: ranks that clip the averaged gradients compute one; each
rank's own norm differs) and its loss as backward ran on it, summed over the step's backward calls
(``parity_step``: a per-step kind, thinned past the run-directory budget's ring like the step records): under
gradient accumulation the step record's loss is the micro-batches' mean, not the loss whose gradient the step
applies.

All of it is device work, read with the step's other values in its one device-to-host transfer (``probe``),
written as one ``parity`` record. Gradients are read as the optimizer used them: reduced (averaged) under DDP,
so one rank's record is the job's.

``twin``: this run is the reference's twin. Before its first forward and after each step the last bit of a random
half of every parameter's elements is flipped (float32: one unit in the last place; a generator seeded by the
step): the noise a different but mathematically equal order of sums leaves, every step, whose growth over the
steps is the band a candidate is judged against (``analysis.parity``). Under autocast to a lower dtype, that
dtype's last bit, in the parameters and in each step's gradients (as backward makes them, or before the optimizer's
step where no hook sees them: FSDP2's sharded gradients). A twin's results differ from its reference on purpose.

Sharded parameters (DTensors: FSDP2, tensor parallel, HSDP) are recorded by every rank that holds the first
replica of a part, sketched at the part's global place, so that the parts' sketches sum to the whole tensor's:
a sharded candidate is compared with a whole reference without gathering anything. A ZeRO-3 partition is a block
of the flattened tensor, recorded at its offset the same way; a pipeline's stages each record their own layers
(plain tensors: the ranks of rank 0's pipeline; a rank that runs several stages, an interleaved schedule, records
each when their names are the whole model's, and says so otherwise: not compared). Cost per recorded step: on
the rank that holds a tensor (rank 0 for a replicated one), two passes over the parameters, buffers and gradients
(the sketch's fold) and about 5 KB of record per parameter (two sketches of 128 float64 numbers as JSON); on
every rank, one pass over its replicated gradients (their norms) and the data's fingerprint (a float64 copy of
each sample's first WIDTH numbers, and a product with 8 directions).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch

from distdebug.artifacts import schema
from distdebug.config import ParityConfig, chosen_steps
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding

WIDTH = 4096
"""The data's fingerprint reads each sample's first WIDTH numbers: enough to tell samples apart, bounded memory."""


class ParityRecorder(Detector):
    name = "parity"
    description = "records what distdebug parity compares (attach --parity)"
    default = False
    needs_model = True
    Config = ParityConfig

    def __init__(self, config: ParityConfig | None = None) -> None:
        self.config = config or ParityConfig()
        self.listed, self.pow2 = chosen_steps(self.config.steps)
        self.ctx: RankContext | None = None
        self.named: list[tuple[str, torch.Tensor]] = []
        self._places: dict[str, tuple[int, ...] | None] = {}
        self._names: list[str] = []
        self._dtypes: list[str] = []
        self.buffers: list[tuple[str, torch.Tensor]] = []
        self.stages_recorded = 1
        """The models this rank records: one, or each pipeline stage it runs (an interleaved schedule)."""
        self._buffer_names: list[str] = []
        self._buffer_dtypes: list[str] = []
        self._plain: list[str] = []
        self._grads = True
        self._first_forward: Any = None
        self._data_hook: Any = None
        self.current = 1
        """The step in progress (1 until the first boundary)."""
        self._data: torch.Tensor | None = None
        self._rows = 0
        self._no_data = False
        """A training forward of this step had no tensor to fingerprint: the step's data is not compared."""
        self._proj: dict[str, torch.Tensor] = {}
        """The data fingerprint's directions, one set per device (``_directions``)."""
        self._widths: set[int] = set()
        """The widths (numbers per sample, at most WIDTH) of the step's fingerprinted inputs."""
        self._loss_total: float | None = None
        """The step's loss sum when the script gave a number (distdebug.step(loss) with a float): no tensor to read."""
        self._autocast: str | None = None
        """The dtype training forwards compute in under autocast (``bfloat16``), None without: recorded, and the
        twin's perturbation is of that dtype's last bit."""
        self._backwards = 0
        """Gradients the twin has rounded so far (each draws a new pattern)."""
        self._twin_params: list[tuple[str, torch.Tensor]] = []
        """The twin's parameters, in the order of their gradient hooks."""
        self._rounded: set[int] = set()
        """The twin's parameters whose gradient was rounded this step (by its hook, or before the optimizer step)."""
        self._handles: list[Any] = []
        """Hooks on the model: the twin's gradient rounding, the autocast reader (removed at the end)."""
        self._clips: list[torch.Tensor] = []
        """The norms the step's clipping calls clipped by (device tensors, read with the step's values): ranks
        that clip by one global norm compute the same; each rank's own (clipping before the reduction, a shard's
        norm) differs between them."""

    def setup(self, ctx: RankContext) -> None:
        from distdebug.runtime.session import current_session

        session = current_session()
        if session is not None:  # the clock keeps the loss as backward ran on it only for this recorder
            session.clock.keep_raw = True
        # the outermost module's first forward (the twin's noise starts before it, so that step 1 has a band too;
        # the data's fingerprint is taken at every forward of that module from then on)
        self._first_forward = torch.nn.modules.module.register_module_forward_pre_hook(
            self.guarded(self._before_first_step))
        self._watch_clipping(ctx)

    def _watch_clipping(self, ctx: RankContext) -> None:
        """The norms the script clips by, under both of torch's ways: ``clip_grad_norm_`` (the norm it computes and
        returns) and, from torch 2.6, ``get_total_norm`` then ``clip_grads_with_norm_`` (torchtitan's: the norm
        given to the second, made whole first where it was a DTensor's). ``clip_grad_norm_`` calls the second under
        its private name: one norm a call, never two."""
        from torch.nn import utils as nn_utils

        self.patch_clip_grad_norm(ctx, self._watch_clip)
        if hasattr(nn_utils, "clip_grads_with_norm_"):
            self.patch(ctx, nn_utils, "clip_grads_with_norm_", self._watch_clip_with_norm)

    def _keep_clip(self, total: Any) -> None:
        """A norm clipped by, kept (no read: it travels with the step's values). A DTensor norm (FSDP2's, tensor
        parallelism's) is left out: its local value is a part, the clip's own arithmetic makes it whole."""
        if torch.compiler.is_compiling():  # inside a compiled region: nothing of ours is traced into it
            return
        if isinstance(total, torch.Tensor) and type(total).__name__ != "DTensor" and total.numel() == 1 \
                and len(self._clips) < 64:
            self._clips.append(total.detach().reshape(()).to(torch.float64, copy=True))

    def _watch_clip(self, original: Any) -> Any:
        """clip_grad_norm_ as the script calls it, the norm it returns kept."""
        det = self

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            total = original(*args, **kwargs)
            det._keep_clip(total)
            return total

        return clip_grad_norm_

    def _watch_clip_with_norm(self, original: Any) -> Any:
        """clip_grads_with_norm_(parameters, max_norm, total_norm, foreach) as the script calls it, the norm it is
        given kept."""
        det = self

        def clip_grads_with_norm_(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            det._keep_clip(kwargs["total_norm"] if "total_norm" in kwargs else args[2] if len(args) > 2 else None)
            return out

        return clip_grads_with_norm_

    def _before_first_step(self, module: torch.nn.Module, args: Any) -> None:
        """The outermost module's first forward (the first module called is the one that calls the others): the
        twin's parameters perturbed as after a step 0 (before autograd has seen them); the data's fingerprint hook
        moved onto that module (a global hook would run at every module's call), first of its pre-hooks (before a
        wrapper's own casts its inputs). This call's data: its positional arguments here (a global hook sees no
        keyword arguments: a call by keywords only, ``model(**batch)``, is read by a hook after its forward)."""
        if self._first_forward is None:
            return
        self._first_forward.remove()
        self._first_forward = None
        self._seen_autocast(module)
        if self.config.twin:
            named: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            self._perturb(0, named)
            self._twin_params = named
            for i, (_, p) in enumerate(named):  # each backward's gradients, under autocast (_round_grad)
                self._handles.append(p.register_hook(self.guarded(functools.partial(self._round_grad, i))))
            # the gradients no hook of a parameter sees (FSDP2 writes its sharded parameters' gradients after its
            # reduce-scatter; a DTensor's): rounded before the optimizer's step instead
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._handles.append(register_optimizer_step_pre_hook(self.guarded(self._round_unhooked)))
        # autocast as the forward runs (a framework may enter it inside forward: accelerate wraps it): read at the
        # pre-hook of the first module that holds parameters, inside the outermost one's forward
        leaf = next((m for m in module.modules() if next(m.parameters(recurse=False), None) is not None), None)
        if leaf is not None:
            self._handles.append(leaf.register_forward_pre_hook(self.guarded(
                lambda m, a: self._seen_autocast(m) if m.training and torch.is_grad_enabled() else None)))
        self._data_hook = module.register_forward_pre_hook(self.guarded(self._fingerprint), with_kwargs=True,
                                                           prepend=True)
        if _first_tensor(args) is not None:
            self._fingerprint(module, args, {})
            return
        once: list[Any] = []

        def after(mod: torch.nn.Module, a: Any, kwargs: dict[str, Any], out: Any) -> None:
            once[0].remove()
            self._fingerprint(mod, a, kwargs)

        once.append(module.register_forward_hook(self.guarded(after), with_kwargs=True))

    def _fingerprint(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """Add this forward's samples to the step's data fingerprint (device work, at recorded steps only): the
        first tensor among the arguments, then the keyword arguments (one level into a dict, list or tuple), one
        sample per row, and its width. Not a training forward of the step (an evaluation, a re-execution of a
        step by the harness): not counted. A tensor it cannot read (nested, sparse, a DTensor): the step's data
        is not compared, nothing else is lost."""
        if not module.training or not torch.is_grad_enabled() or not self.wanted(self.current):
            return
        from distdebug.runtime.session import current_session

        session = current_session()
        if session is not None and session.reexecution.replay_step is not None:
            return
        t = _first_tensor((*args, *kwargs.values()))
        if t is None or type(t).__name__ == "DTensor" or t.layout != torch.strided:
            self._no_data = True
            return
        try:
            with torch.no_grad():
                # a sample's first WIDTH numbers (an image's 150,000 in float64 would be 1.2 MB a sample)
                x = t.detach().reshape(t.shape[0], -1)[:, :WIDTH].to(torch.float64)
                key = str(x.device)
                proj = self._proj.get(key)
                if proj is None:  # device arithmetic, no generator and no copy from the host
                    proj = self._proj[key] = _directions(x.device)
                s = torch.sin(x @ proj[: x.shape[1]]).sum(0)
                total = s if self._data is None else self._data + s
        except Exception:  # a tensor of a kind the fingerprint cannot read: no data compared this step
            self._no_data = True
            return
        self._data = total
        self._rows += int(t.shape[0])
        self._widths.add(int(x.shape[1]))

    def attach(self, ctx: RankContext) -> None:
        from distdebug.runtime.discovery import unwrap

        self.ctx = ctx
        models = [unwrap(m)[0] for m in ctx.models]
        if not models:
            return
        stage = ctx.layout.stage if ctx.layout is not None else None
        held = len((stage or {}).get("indices") or [0])
        if held > 1:
            # an interleaved schedule: each stage this rank runs is a model of its own, found by discovery as such;
            # all are recorded when their names are the whole model's (torchtitan's split: no name in two stages)
            from distdebug.runtime.layout import pipeline_stage

            stages = [m for m in models if pipeline_stage(m) is not None]
            names = [n for m in stages for n, _ in (*m.named_parameters(), *m.named_buffers())]
            whole = len(stages) == held and len(set(names)) == len(names)
            models = stages if whole else models[:1]
        else:
            models = models[:1]
        self.stages_recorded = len(models)
        self.named = [(n, p) for m in models for n, p in m.named_parameters() if p.requires_grad]
        self.buffers = [(n, b) for m in models for n, b in m.named_buffers() if b.is_floating_point()]

    def wanted(self, step: int) -> bool:
        return step in self.listed or (self.pow2 and step > 0 and step & (step - 1) == 0)

    def _place(self, key: str, t: torch.Tensor) -> tuple[int, ...] | None:
        """Whether this rank sketches ``t`` and where its part sits in the whole tensor, worked out once per tensor
        (a placement does not change between steps; ``key``: the tensor's name and kind): ``()`` for a whole tensor,
        the part's (local shape, global offset, global shape) flattened for a DTensor's, None: not this rank's.

        A plain tensor is replicated (DDP, or a hand-written all-reduce): rank 0 records it whole; on a pipeline,
        where each stage holds its own layers, every rank of rank 0's pipeline records its stage's. A DTensor
        (FSDP2, tensor parallel, HSDP) is recorded by every rank that holds the first replica of its shard: its
        local part at its global place, so that the parts' sketches sum to the whole tensor's. A ZeRO-3 partition
        is a block of the flattened tensor (``_zero3_place``)."""
        if key in self._places:
            return self._places[key]
        place: tuple[int, ...] | None
        if hasattr(t, "ds_id"):
            place = _zero3_place(t)
        elif type(t).__name__ != "DTensor":
            place = () if self._records_plain() else None
        else:
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
            coord = mesh.get_coordinate()
            if coord is None or any(isinstance(pl, Replicate) and coord[d] != 0 for d, pl in enumerate(placements)):
                place = None  # another replica of the same part records it
            else:
                shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
                place = (*shape, *offset, *t.shape)
        self._places[key] = place
        return place

    def _records_plain(self) -> bool:
        """Whether this rank records the plain (replicated) tensors: rank 0, or on a pipeline each rank of rank 0's
        pipeline, the one replica of its stage's layers there (the stage's group, from runtime.layout: a pipeline
        whose stages also split their layers over tensor-parallel peers without DTensors would count a layer
        twice)."""
        if self.ctx is None:
            return False
        stage = self.ctx.layout.stage if self.ctx.layout is not None else None
        if stage:
            return 0 in (stage.get("ranks") or [self.ctx.rank])
        return self.ctx.rank == 0

    @staticmethod
    def _sketch(t: torch.Tensor, place: tuple[int, ...], seed: int) -> torch.Tensor:
        """The sketch of a tensor or of its part at its place (``_place``): a whole tensor or a block of whole rows
        (FSDP2's ``Shard(0)``, a ZeRO-3 partition) at its global flat offset; any other block (a column shard) with
        each element's global index, made a chunk at a time (``sketch_block``). At a recorded step only."""
        from distdebug.fingerprint.sketch import sketch, sketch_block

        if not place:
            return sketch(t, seed)
        n = len(place) // 3
        shape, offset, full = place[:n], place[n:2 * n], place[2 * n:]
        if shape[1:] == full[1:] and not any(offset[1:]):
            return sketch(t, seed, offset=offset[0] * math.prod(full[1:]) if full else 0)
        return sketch_block(t, offset, full, seed)

    def probe(self, step: int) -> dict[str, Any] | None:
        if self.ctx is None or not self.named:
            return None
        seed = self.config.seed
        with torch.no_grad():
            # (name, the parameter's part and place, the gradient's part and place): a DTensor's gradient may be
            # placed otherwise than its parameter (sequence parallelism), so each is taken by its own placements
            owned: list[tuple[str, torch.Tensor, tuple[int, ...], torch.Tensor, tuple[int, ...]]] = []
            for n, p in self.named:
                place = self._place(f"param:{n}", p)
                if place is None:
                    continue
                value = _zero3_part(p, place) if hasattr(p, "ds_id") else _local(p).detach()
                gplace = self._place(f"grad:{n}", p.grad) if p.grad is not None else None
                # a missing gradient (unused this step, frozen later) is recorded as zeros: against a reference that
                # has one, it departs by the whole gradient
                grad = _local(p.grad) if gplace is not None else torch.zeros_like(value)  # type: ignore[arg-type]
                owned.append((n, value, place, grad, place if gplace is None else gplace))
            # no gradient at all at the boundary (DeepSpeed ZeRO keeps them in its own buffers): the parameters are
            # compared, the gradients are said to be missing rather than read as zeros
            self._grads = any(p.grad is not None for _, p in self.named)
            out: dict[str, Any] = {}
            # every step, every rank: the sum of the losses backward ran on this step (the loss whose gradient is
            # the step's accumulated gradient: a mean of micro-batches' losses is not, and a framework's division
            # is part of it), read with the step's values
            from distdebug.runtime.session import current_session

            session = current_session()
            # not on a pipeline: its schedule divides the gradients by the micro-batch count after their backward
            # calls (scale_grads), so the sum is that many times the loss the step applies; the step record's loss
            # (the micro-batches' mean, on the last stage) is
            stage = self.ctx.layout.stage if self.ctx.layout is not None else None
            total = session.clock.raw_sum if session is not None and not stage else None
            if isinstance(total, torch.Tensor):
                out["loss_total"] = total
            elif isinstance(total, float):
                self._loss_total = total
            if self._clips and len({c.device for c in self._clips}) == 1:
                out["clip"] = torch.stack(self._clips)
            if owned:  # float64 sums of squares without a float64 copy of each gradient
                grad_sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
                                       for _, _, _, g, _ in owned])
                if self._grads:
                    out["grad_sq_sum"] = grad_sq.sum()
            if not self.wanted(step):
                return out or None  # every step: this rank's part of the gradients' global norm
            # every rank, at a recorded step: the data its forwards saw, each replicated gradient's sum of squares
            # (one a rank never reduced disagrees across the ranks)
            if self._data is not None and not self._no_data:
                out["data"] = self._data
            plain = [(n, p.grad) for n, p in self.named if p.grad is not None and type(p).__name__ != "DTensor"
                     and not hasattr(p, "ds_id") and getattr(p, "_st_info", None) is None]
            self._plain = [n for n, _ in plain]
            if plain:
                out["rank_grad_sq"] = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
                                                   for _, g in plain])
            if not owned:
                return out or None
            bufs = [(n, _local(b), place) for n, b in self.buffers
                    if (place := self._place(f"buffer:{n}", b)) is not None]
            self._buffer_names = [n for n, _, _ in bufs]
            self._buffer_dtypes = [str(b.dtype) for _, b, _ in bufs]

            def sk(t: torch.Tensor, place: tuple[int, ...]) -> torch.Tensor:
                return self._sketch(t, place, seed)

            self._names = [n for n, *_ in owned]  # host-side: which parts the values below are
            self._dtypes = [str(v.dtype) for _, v, *_ in owned]
            grads = {"grad": torch.stack([sk(g, gw) for _, _, _, g, gw in owned]), "grad_sq": grad_sq} \
                if self._grads else {}
            if bufs:
                out["buffer"] = torch.stack([sk(b, w) for _, b, w in bufs])
                out["buffer_sq"] = torch.stack([torch.linalg.vector_norm(b, dtype=torch.float64) ** 2
                                                for _, b, _ in bufs])
            return {**out, **grads, "param": torch.stack([sk(v, w) for _, v, w, _, _ in owned]),
                    "param_sq": torch.stack([torch.linalg.vector_norm(v, dtype=torch.float64) ** 2
                                             for _, v, _, _, _ in owned])}

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        ctx = self.ctx
        got = self.values(event)
        total = got.get("loss_total", self._loss_total)
        self._loss_total = None
        if ctx is not None and ("grad_sq_sum" in got or total is not None or "clip" in got):
            # every step: this rank's part of the gradients' global norm, its loss as backward ran on it, the norms
            # its clipping computed
            ctx.emit(schema.PARITY_STEP, step=event.step, **({"grad_sq_sum": got["grad_sq_sum"]}
                                                            if "grad_sq_sum" in got else {}),
                     **({"loss_total": total} if total is not None else {}),
                     **({"clip": got["clip"]} if "clip" in got else {}))
        self._clips = []
        if ctx is not None and self.named and self.wanted(event.step):
            # the parts this rank recorded; every rank's loss (the global loss is their mean: in every step record)
            tensors = {} if "param" not in got else {
                "names": self._names, "dtypes": self._dtypes, "param": got["param"], "param_sq": got["param_sq"],
                **({"grad": got["grad"], "grad_sq": got["grad_sq"]} if "grad" in got else {}),
                **({"buffer_names": self._buffer_names, "buffer_dtypes": self._buffer_dtypes,
                    "buffer": got["buffer"], "buffer_sq": got["buffer_sq"]} if "buffer" in got else {}),
                **self._optimizer()}
            extra = {"rank_names": self._plain, "rank_grad_sq": got["rank_grad_sq"]} if "rank_grad_sq" in got else {}
            if "data" in got:
                extra.update(data=got["data"], rows=self._rows, widths=sorted(self._widths))
            extra.update(self._where_in_layout())
            ctx.emit(schema.PARITY, step=event.step, loss=event.loss, seed=self.config.seed, twin=self.config.twin,
                     autocast=self._autocast, **tensors, **extra)
        self._data, self._rows, self._no_data = None, 0, False
        self._widths = set()
        self.current = event.step + 1
        self._rounded = set()
        if self.config.twin and self.named:
            self._perturb(event.step, self.named)
        return ()

    def _where_in_layout(self) -> dict[str, Any]:
        """This rank's data-parallel group (the ranks whose batches together are the global batch, whose replicated
        gradients must agree: None, every rank) and whether it is a pipeline's first stage (the one the data goes
        into): which ranks' data and gradients the comparison reads (runtime.layout)."""
        lay = self.ctx.layout if self.ctx is not None else None
        if lay is None:
            return {}
        group = lay.data_group()
        stage = lay.stage or {}
        return {"dp": group if group is not False else [self.ctx.rank] if self.ctx is not None else None,
                "first_stage": (stage.get("index") or 0) == 0 and 0 in (stage.get("indices") or [0]),
                "stages_held": len(stage.get("indices") or [0]), "stages_recorded": self.stages_recorded}

    def on_end(self) -> Iterable[Finding]:
        for h in (self._first_forward, self._data_hook, *self._handles):
            if h is not None:
                h.remove()
        self._first_forward = self._data_hook = None
        self._handles = []
        return ()

    def _optimizer(self) -> dict[str, Any]:
        """Host-side, with the tensors' record: each optimizer's parameter groups' numbers (a tensor learning rate
        is left out: reading it would stall the host) and the dtype of each parameter's floating state."""
        if self.ctx is None:
            return {}
        names = {id(p): n for n, p in self.named}
        hyper: list[dict[str, Any]] = []
        state: dict[str, dict[str, str]] = {}
        for opt in self.ctx.optimizers:
            for group in getattr(opt, "param_groups", ()):
                hyper.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                              if k != "params" and not isinstance(v, bool) and (
                                  isinstance(v, (int, float)) or (isinstance(v, tuple) and v
                                                                   and all(isinstance(x, float) for x in v)))})
            held = getattr(opt, "state", None)
            if not isinstance(held, dict):
                continue
            for p, st in held.items():
                n = names.get(id(p))
                if n is not None and isinstance(st, dict):
                    kinds = {k: str(v.dtype).replace("torch.", "") for k, v in st.items()
                             if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0}
                    if kinds:
                        state[n] = kinds
        return {"hyper": hyper, "state_dtypes": state}

    @property
    def _low_bit(self) -> int:
        """Under autocast to a lower dtype, the bit of a float32 that is that dtype's last (16 for bfloat16, 13 for
        float16): where the twin flips; 0 without autocast."""
        return {"bfloat16": 16, "float16": 13}.get(self._autocast or "", 0)

    def _perturb(self, step: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """The twin's noise: the last bit of a random half of each parameter's elements flipped (device work). Under
        autocast to a lower dtype, the last bit of that dtype (a float32 parameter's bit 16 for bfloat16, 13 for
        float16): the rounding the forward computes with, where a float32 flip would mostly vanish in the cast."""
        shift = self._low_bit
        with torch.no_grad():
            for i, (_, p) in enumerate(named):
                bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
                        torch.float64: torch.int64}.get(p.dtype)
                if bits is None:
                    continue
                # a ZeRO-3 parameter: its partition, the values the next forward gathers; and where DeepSpeed keeps
                # it whole between steps (a persistent parameter, gathered again inside the step), that whole copy
                # too, the one the next forward reads (not where it is the partition itself: one rank)
                targets = [_local(p) if type(p).__name__ == "DTensor" else p.data]
                if hasattr(p, "ds_id"):
                    part = p.ds_tensor.data  # type: ignore[attr-defined]
                    whole = p.data
                    targets = [part] + ([whole] if whole.numel() == int(p.ds_numel)  # type: ignore[attr-defined]
                                        and whole.data_ptr() != part.data_ptr() else [])
                for k, t in enumerate(targets):
                    flip = _flips(t, self.config.seed * 1_000_003 + step * 4099 + i + 7919 * k, bits)
                    if shift and p.dtype == torch.float32:
                        flip.bitwise_left_shift_(shift)
                    t.view(bits).bitwise_xor_(flip)

    def _round_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor | None:
        """The twin under autocast to a lower dtype: each backward's gradient rounded otherwise, as a sum in that
        dtype over another split of the batch rounds it (the last bit of that dtype in a random half of a float32
        gradient's elements), as backward computes it (a tensor hook: before its accumulation and before DDP
        reduces it). Perturbing the parameters alone leaves the first step's gradients without the rounding of
        their own sums: a bfloat16 candidate's first gradients then read as a departure."""
        shift = self._low_bit
        if not shift or grad.dtype != torch.float32 or type(grad).__name__ == "DTensor":
            return None  # a DTensor's: _round_unhooked, before the optimizer's step
        self._rounded.add(i)
        self._backwards += 1
        flip = _flips(grad, self.config.seed * 1_000_003 + self.current * 4099 + self._backwards * 131 + i + 7,
                      torch.int32)
        rounded = (grad.detach().contiguous().view(torch.int32) ^ flip.bitwise_left_shift_(shift)).view(torch.float32)
        return grad + (rounded - grad).detach()  # the same value, still differentiable (a double backward)

    def _round_unhooked(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The twin under autocast to a lower dtype, before an optimizer's step: the gradients its hooks did not
        round this step rounded in place, as ``_round_grad`` rounds (the last bit of that dtype in a random half of
        the elements): FSDP2's sharded gradients, written after its reduce-scatter where no hook of the parameter
        runs, and a DTensor's (its local part). Without it the first step's gradients of an FSDP2 reference's twin
        keep float32's rounding, and a healthy bfloat16 candidate's read as a departure at step 1."""
        shift = self._low_bit
        if not shift:
            return
        with torch.no_grad():
            for i, (_, p) in enumerate(self._twin_params):
                grad = p.grad
                if i in self._rounded or grad is None:
                    continue
                local = _local(grad)
                if local.dtype != torch.float32 or not local.is_contiguous():
                    continue
                self._rounded.add(i)
                seed = self.config.seed * 1_000_003 + self.current * 4099 + i * 131 + 104_729
                flip = _flips(local, seed, torch.int32)
                local.view(torch.int32).bitwise_xor_(flip.bitwise_left_shift_(shift))

    def _seen_autocast(self, module: torch.nn.Module) -> None:
        """The dtype a training forward computes in under autocast (None: its parameters' own), read from torch's
        host-side autocast state for the device of the module's first parameter."""
        p = next(module.parameters(), None)
        kind = p.device.type if p is not None else "cpu"
        try:
            on = torch.is_autocast_enabled(kind)
            self._autocast = str(torch.get_autocast_dtype(kind)).replace("torch.", "") if on else None
        except (RuntimeError, TypeError):  # a device type autocast does not know
            self._autocast = None


def _flips(t: torch.Tensor, seed: int, bits: torch.dtype) -> torch.Tensor:
    """A random half of ``t``'s elements 1, the others 0, as integers of type ``bits`` (t's size): the twin's pattern
    of flipped bits, drawn on t's device from ``seed``."""
    gen = torch.Generator(device=t.device).manual_seed(seed)
    return torch.randint(0, 2, t.shape, generator=gen, device=t.device, dtype=bits)


def _first_tensor(values: Any) -> torch.Tensor | None:
    """The first tensor of one or more dimensions with elements among ``values``, looking one level into a dict,
    list or tuple (a batch passed as one dict)."""
    for v in values:
        for x in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.numel() > 0 and not x.is_complex():
                return x
    return None


def _directions(device: torch.device) -> torch.Tensor:
    """WIDTH x 8 fixed directions for the data's fingerprint, the same on every device and in every run: cosines
    of incommensurate frequencies (no generator: a device's random numbers are not the host's). A narrower input
    uses the first rows, so that zero padding at a sample's end leaves its fingerprint as it was."""
    i = torch.arange(1, WIDTH + 1, dtype=torch.float64, device=device)[:, None]
    k = torch.arange(1, 9, dtype=torch.float64, device=device)[None, :]
    return torch.cos(i * (math.sqrt(2) * k + math.pi / 7) + k * math.e)


def _zero3_place(t: Any) -> tuple[int, ...] | None:
    """A ZeRO-3 parameter's partition as a part of the flattened tensor: ``(held, offset, numel)``, this rank's
    ``ds_tensor`` is elements ``offset`` to ``offset + held`` of the parameter flattened (DeepSpeed pads the
    flattened tensor to a multiple of its partition group's size and gives rank r of that group the r-th equal
    block: ``partition_parameters._partition_param``); the last rank's padding is not part of it. Recorded by the
    partition group that holds rank 0 (under MiCS other groups hold replicas). None: not this rank's, or
    not partitioned."""
    import torch.distributed as dist

    part, group = getattr(t, "ds_tensor", None), getattr(t, "ds_process_group", None)
    if part is None or not dist.is_initialized():
        return None
    if 0 not in dist.get_process_group_ranks(group or dist.group.WORLD):
        return None
    size = part.numel()
    offset = dist.get_rank(group=group) * size
    return (max(0, min(size, int(t.ds_numel) - offset)), offset, int(t.ds_numel))


def _zero3_part(t: Any, place: tuple[int, ...]) -> torch.Tensor:
    """This rank's elements of a ZeRO-3 parameter (``_zero3_place``), without its padding."""
    return t.ds_tensor.detach().view(-1)[:place[0]]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part; any other tensor itself."""
    return t.to_local() if type(t).__name__ == "DTensor" else t  # type: ignore[attr-defined]
