"""ParityRecorder (``attach --parity``): what ``distdebug parity`` compares between two runs of one training.

A recorder, not a detector: it finds nothing in its own run. At the chosen steps (``steps``: the first eight,
then each power of two: where a departure starts, and how rounding grows after) it records, at the step
boundary (after the optimizer's step, before the script zeroes the gradients), for every parameter of the
model discovery found (by its name inside the wrappers: a DDP run's and a plain run's names agree):

- the gradient's and the parameter's sketch (``fingerprint.sketch``: 128 float64 numbers each, linear, so that
  two runs' distance is the distance of their sketches) and their float64 sums of squares;
- the rank's loss and the gradients' global norm (the norm of every gradient together).

At every step rank 0 also records the gradients' global norm (``parity_step``: a per-step kind, thinned past the
run-directory budget's ring like the step records); every rank's loss is in its step records already.

All of it is device work, read with the step's other values in its one device-to-host transfer (``probe``),
written as one ``parity`` record. Gradients are read as the optimizer used them: reduced (averaged) under DDP,
so one rank's record is the job's.

``twin``: this run is the reference's twin. Before its first forward and after each step the last bit of a random
half of every parameter's elements is flipped (float32: one unit in the last place; a generator seeded by the
step): the noise a different but mathematically equal order of sums leaves, every step, whose growth over the
steps is the band a candidate is judged against (``analysis.parity``). A twin's results differ from its
reference on purpose.

Sharded parameters (DTensors: FSDP2, tensor parallel, HSDP) are recorded by every rank that holds the first
replica of a part, sketched at the part's global place, so that the parts' sketches sum to the whole tensor's:
a sharded candidate is compared with a whole reference without gathering anything. Not recorded: ZeRO-3's
partitions (their global offsets are not exposed the same way). Cost per recorded step, on rank 0
only (the others record their loss): two passes over the parameters and gradients (the sketch's fold) and about
5 KB of record per parameter (two sketches of 128 float64 numbers as JSON).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from distdebug.artifacts import schema
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding


def chosen_steps(spec: str) -> tuple[set[int], bool]:
    """``steps``: ``1-8`` ranges and single steps, comma-separated, and ``pow2``: every power of two. Returns
    (the listed steps, whether powers of two are in)."""
    out: set[int] = set()
    pow2 = False
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part == "pow2":
            pow2 = True
        elif "-" in part:
            a, b = part.split("-", 1)
            out |= set(range(int(a), int(b) + 1))
        else:
            out.add(int(part))
    return out, pow2


@dataclass(kw_only=True)
class ParityConfig:
    steps: str = "1-8,pow2"
    """The steps recorded: ranges and steps, comma-separated, and ``pow2`` (every power of two)."""
    twin: bool = False
    """This run is the reference's twin: the last bit of a random half of each parameter flipped every step."""
    seed: int = 0
    """The sketches' seed: two runs compared must use the same."""


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
        self._grads = True
        self._first_forward: Any = None

    def setup(self, ctx: RankContext) -> None:
        if self.config.twin:  # the twin's noise starts before its first step, so that step 1 has a band too
            self._first_forward = torch.nn.modules.module.register_module_forward_pre_hook(
                self.guarded(self._before_first_step))

    def _before_first_step(self, module: torch.nn.Module, args: Any) -> None:
        """The outermost module's first forward: its parameters perturbed as after a step 0 (before autograd has
        seen them), then the hook is gone."""
        if self._first_forward is None:
            return
        self._first_forward.remove()
        self._first_forward = None
        self._perturb(0, [(n, p) for n, p in module.named_parameters() if p.requires_grad])

    def attach(self, ctx: RankContext) -> None:
        from distdebug.runtime.discovery import unwrap

        self.ctx = ctx
        models = ctx.models
        if models:
            inner = unwrap(models[0])[0]
            self.named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]

    def wanted(self, step: int) -> bool:
        return step in self.listed or (self.pow2 and step > 0 and step & (step - 1) == 0)

    def _place(self, key: str, t: torch.Tensor) -> tuple[int, ...] | None:
        """Whether this rank sketches ``t`` and where its part sits in the whole tensor, worked out once per tensor
        (a placement does not change between steps; ``key``: the tensor's name and kind): ``()`` for a whole tensor,
        the part's (local shape, global offset, global shape) flattened for a DTensor's, None: not this rank's.

        A plain tensor is replicated (DDP, or a hand-written all-reduce): rank 0 records it whole. A DTensor
        (FSDP2, tensor parallel, HSDP) is recorded by every rank that holds the first replica of its shard: its
        local part at its global place, so that the parts' sketches sum to the whole tensor's. A ZeRO-3 partition
        (no global offset exposed here) is not recorded."""
        if key in self._places:
            return self._places[key]
        place: tuple[int, ...] | None
        if hasattr(t, "ds_id"):
            place = None
        elif type(t).__name__ != "DTensor":
            place = () if self.ctx is not None and self.ctx.rank == 0 else None
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

    @staticmethod
    def _where(place: tuple[int, ...], device: torch.device) -> int | torch.Tensor:
        """Where a part sits, for its sketch (at a recorded step only): the global flat offset of a whole tensor or a
        block of whole rows, else every element's global flat index."""
        if not place:
            return 0
        n = len(place) // 3
        shape, offset, full = place[:n], place[n:2 * n], place[2 * n:]
        if shape[1:] == full[1:] and not any(offset[1:]):
            return offset[0] * math.prod(full[1:]) if full else 0  # a block of whole rows
        index = torch.zeros(shape, dtype=torch.int64, device=device)
        for d in range(n):
            view = [1] * n
            view[d] = shape[d]
            index += (torch.arange(offset[d], offset[d] + shape[d], device=device) * math.prod(full[d + 1:])).view(view)
        return index

    def probe(self, step: int) -> dict[str, Any] | None:
        if self.ctx is None or not self.named:
            return None
        from distdebug.fingerprint.sketch import sketch, sketch_indexed

        seed = self.config.seed
        with torch.no_grad():
            # (name, the parameter's part and place, the gradient's part and place): a DTensor's gradient may be
            # placed otherwise than its parameter (sequence parallelism), so each is taken by its own placements
            owned: list[tuple[str, torch.Tensor, tuple[int, ...], torch.Tensor, tuple[int, ...]]] = []
            for n, p in self.named:
                place = self._place(f"param:{n}", p)
                if place is None:
                    continue
                value = _local(p).detach()
                gplace = self._place(f"grad:{n}", p.grad) if p.grad is not None else None
                # a missing gradient (unused this step, frozen later) is recorded as zeros: against a reference that
                # has one, it departs by the whole gradient
                grad = _local(p.grad) if gplace is not None else torch.zeros_like(value)  # type: ignore[arg-type]
                owned.append((n, value, place, grad, place if gplace is None else gplace))
            if not owned:
                return None
            # no gradient at all at the boundary (DeepSpeed ZeRO keeps them in its own buffers): the parameters are
            # compared, the gradients are said to be missing rather than read as zeros
            self._grads = any(p.grad is not None for _, p in self.named)
            # float64 sums of squares without a float64 copy of each gradient
            grad_sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for _, _, _, g, _ in owned])
            out: dict[str, Any] = {"grad_sq_sum": grad_sq.sum()} if self._grads else {}
            if not self.wanted(step):
                return out or None  # every step: this rank's part of the gradients' global norm

            def sk(t: torch.Tensor, place: tuple[int, ...]) -> torch.Tensor:
                where = self._where(place, t.device)
                return sketch(t, seed, offset=where) if isinstance(where, int) else sketch_indexed(t, where, seed)

            self._names = [n for n, *_ in owned]  # host-side: which parts the values below are
            self._dtypes = [str(v.dtype) for _, v, *_ in owned]
            grads = {"grad": torch.stack([sk(g, gw) for _, _, _, g, gw in owned]), "grad_sq": grad_sq} \
                if self._grads else {}
            return {**out, **grads, "param": torch.stack([sk(v, w) for _, v, w, _, _ in owned]),
                    "param_sq": torch.stack([torch.linalg.vector_norm(v, dtype=torch.float64) ** 2
                                             for _, v, _, _, _ in owned])}

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        ctx = self.ctx
        got = self.values(event)
        if ctx is not None and "grad_sq_sum" in got:  # this rank's part of the gradients' global norm, every step
            ctx.emit(schema.PARITY_STEP, step=event.step, grad_sq_sum=got["grad_sq_sum"])
        if ctx is not None and self.named and self.wanted(event.step):
            # the parts this rank recorded; every rank's loss (the global loss is their mean: in every step record)
            tensors = {} if "param" not in got else {
                "names": self._names, "dtypes": self._dtypes, "param": got["param"], "param_sq": got["param_sq"],
                **({"grad": got["grad"], "grad_sq": got["grad_sq"]} if "grad" in got else {})}
            ctx.emit(schema.PARITY, step=event.step, loss=event.loss, seed=self.config.seed, twin=self.config.twin,
                     **tensors)
        if self.config.twin and self.named:
            self._perturb(event.step, self.named)
        return ()

    def _perturb(self, step: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """The twin's noise: the last bit of a random half of each parameter's elements flipped (device work)."""
        with torch.no_grad():
            for i, (_, p) in enumerate(named):
                bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
                        torch.float64: torch.int64}.get(p.dtype)
                if bits is None or hasattr(p, "ds_id"):
                    continue
                t = _local(p) if type(p).__name__ == "DTensor" else p.data
                gen = torch.Generator(device=t.device).manual_seed(self.config.seed * 1_000_003 + step * 4099 + i)
                flip = torch.randint(0, 2, t.shape, generator=gen, device=t.device, dtype=bits)
                t.view(bits).bitwise_xor_(flip)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part; any other tensor itself."""
    return t.to_local() if type(t).__name__ == "DTensor" else t  # type: ignore[attr-defined]
