"""ParityRecorder (``attach --parity``): what ``distdebug parity`` compares between two runs of one training.

A recorder, not a detector: it finds nothing in its own run. At the chosen steps (``steps``: the first eight,
then each power of two: where a departure starts, and how rounding grows after) it records, at the step
boundary (after the optimizer's step, before the script zeroes the gradients), for every parameter of the
model discovery found (by its name inside the wrappers: a DDP run's and a plain run's names agree):

- the gradient's and the parameter's sketch (``fingerprint.sketch``: 128 float64 numbers each, linear, so that
  two runs' distance is the distance of their sketches) and their float64 norms;
- the rank's loss and the gradients' global norm (the norm of every gradient together).

At every step rank 0 also records the gradients' global norm (``parity_step``: a per-step kind, thinned past the
run-directory budget's ring like the step records); every rank's loss is in its step records already.

All of it is device work, read with the step's other values in its one device-to-host transfer (``probe``),
written as one ``parity`` record. Gradients are read as the optimizer used them: reduced (averaged) under DDP,
so one rank's record is the job's.

``twin``: this run is the reference's twin. After each step the last bit of a random half of every parameter's
elements is flipped (float32: one unit in the last place; a generator seeded by the step): the noise a
different but mathematically equal order of sums leaves, every step, whose growth over the steps is the band a
candidate is judged against (``analysis.parity``). A twin's results differ from its reference on purpose.

Not yet recorded: sharded parameters (FSDP2, ZeRO-3, tensor parallel: a DTensor's shard would need its global
offset). Cost per recorded step, on rank 0
only (the others record their loss): two passes over the parameters and gradients (the sketch's fold) and about
5 KB of record per parameter (two sketches of 128 float64 numbers as JSON).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from distdebug.artifacts import schema
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding

PARITY = schema.PARITY


def chosen_steps(spec: str) -> tuple[set[int], int]:
    """``steps``: ``1-8`` ranges and single steps, comma-separated, and ``pow2``: every power of two. Returns
    (the listed steps, 1 if powers of two are in, else 0)."""
    out: set[int] = set()
    pow2 = 0
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part == "pow2":
            pow2 = 1
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
        self.recorded = 0

    def attach(self, ctx: RankContext) -> None:
        from distdebug.runtime.discovery import unwrap

        self.ctx = ctx
        models = ctx.models
        if models:
            inner = unwrap(models[0])[0]
            self.named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]

    def wanted(self, step: int) -> bool:
        return step in self.listed or bool(self.pow2 and step > 0 and step & (step - 1) == 0)

    def probe(self, step: int) -> dict[str, Any] | None:
        ctx = self.ctx
        if ctx is None or ctx.rank != 0 or not self.named or any(_sharded(p) for _, p in self.named):
            return None  # replicated (DDP): rank 0's gradients and parameters are every rank's
        with torch.no_grad():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.named]
            grad_norm = torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
            out: dict[str, Any] = {"global_grad_norm": torch.linalg.vector_norm(grad_norm)}
            if not self.wanted(step):
                return out  # every step: the gradients' global norm alone
            from distdebug.fingerprint.sketch import sketch

            seed = self.config.seed
            params = [p.detach() for _, p in self.named]
            return {**out, "grad": torch.stack([sketch(g, seed) for g in grads]),
                    "param": torch.stack([sketch(p, seed) for p in params]), "grad_norm": grad_norm,
                    "param_norm": torch.stack([torch.linalg.vector_norm(p.double()) for p in params])}

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        ctx = self.ctx
        got = self.values(event)  # rank 0's
        if ctx is not None and "global_grad_norm" in got:
            ctx.emit(schema.PARITY_STEP, step=event.step, global_grad_norm=got["global_grad_norm"])
        if ctx is not None and self.named and self.wanted(event.step):
            # rank 0's tensors; every rank's loss (the global loss is their mean: also in every step record)
            tensors = {} if "grad" not in got else {
                "names": [n for n, _ in self.named], "grad": got["grad"], "param": got["param"],
                "grad_norm": got["grad_norm"], "param_norm": got["param_norm"],
                "global_grad_norm": got["global_grad_norm"]}
            ctx.emit(PARITY, step=event.step, loss=event.loss, seed=self.config.seed, twin=self.config.twin,
                     **tensors)
            self.recorded += 1
        if self.config.twin and self.named:
            self._perturb(event.step)
        return ()

    def _perturb(self, step: int) -> None:
        """The twin's noise: the last bit of a random half of each parameter's elements flipped (device work)."""
        with torch.no_grad():
            for i, (_, p) in enumerate(self.named):
                bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
                        torch.float64: torch.int64}.get(p.dtype)
                if bits is None or _sharded(p):
                    continue
                gen = torch.Generator(device=p.device).manual_seed(self.config.seed * 1_000_003 + step * 4099 + i)
                flip = torch.randint(0, 2, p.shape, generator=gen, device=p.device, dtype=bits)
                p.data.view(bits).bitwise_xor_(flip)


def _sharded(p: torch.Tensor) -> bool:
    """A DTensor (FSDP2, tensor parallel) or a ZeRO-3 partition: not recorded yet (its global offset)."""
    return type(p).__name__ == "DTensor" or hasattr(p, "ds_id")
