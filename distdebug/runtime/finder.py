"""Finding the models: what the first step of a training phase tells about the script's training.

During a discovery step (the first of each phase), global forward hooks note the outermost module of
each forward (DDP, an FSDP2 root, a DeepSpeed engine, or a plain module) and the loss modules; the
all-reduces the script calls tell hand-written gradient sync and the groups of a hand-written layout.
At the step's end the hooks are removed, so later steps take ``nn.Module``'s fast path again, and what
was found is described (runtime.discovery: pure functions on modules; runtime.layout: the parallel
layout). This room keeps that state; the session decides when a discovery starts and ends.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from distdebug.context import RankContext
from distdebug.runtime import discovery
from distdebug.runtime import layout as layout_mod
from distdebug.runtime.clock import StepClock
from distdebug.runtime.reexecution import Reexecution


class Finder:
    """One per session. ``found_engine``: told when a DeepSpeed engine is found (its methods are then
    patched, and its steps mark the boundaries)."""

    def __init__(self, reexecution: Reexecution, clock: StepClock,
                 found_engine: Callable[[torch.nn.Module], None]) -> None:
        self.reexecution = reexecution
        self.clock = clock
        self.found_engine = found_engine
        self.discovering = True
        self.inert = False  # discovery is over but its hooks stay (a compiled model: see end_hooks)
        self.depth = 0
        self.root_refs: list[weakref.ref[torch.nn.Module]] = []  # weak: see RankContext
        self.loss_modules: list[str] = []
        self.reduced_ptrs: dict[int, Any] = {}  # data_ptr -> the process group (None: the default one)
        self.forward_groups: set[Any] = set()  # groups all-reduced over inside a forward in step 1
        self.handles: list[Any] = []

    def install_hooks(self) -> None:
        from torch.nn.modules import module as nn_module

        self.handles = [
            nn_module.register_module_forward_pre_hook(self._fwd_pre),
            nn_module.register_module_forward_hook(self._fwd_post, always_call=True),
        ]

    def _fwd_pre(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or self.inert or self.reexecution.replaying:  # tracing reads no state first
            return  # traced into a compiled graph: nothing of ours goes in (it would only recompile)
        if self.depth == 0:
            self.clock.start()
            self.note_root(module)
        self.depth += 1

    def _fwd_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or self.inert or self.reexecution.replaying:  # tracing reads no state first
            return
        self.depth = max(0, self.depth - 1)

    def note_root(self, module: torch.nn.Module) -> None:
        """The outermost module of a forward (or one given to ``distdebug.watch``): a model, or a loss."""
        if any(module is r for r in self.roots):
            return
        if not discovery.is_model(module):
            if isinstance(module, torch.nn.modules.loss._Loss) and type(module).__name__ not in self.loss_modules:
                self.loss_modules.append(type(module).__name__)
            return
        self.root_refs.append(weakref.ref(module))
        if discovery.is_deepspeed_engine(module):
            self.found_engine(module)

    @property
    def roots(self) -> list[torch.nn.Module]:
        """The models found so far (outermost module of each forward), in the order first seen."""
        return [m for m in (r() for r in self.root_refs) if m is not None]

    def note_all_reduce(self, tensor: torch.Tensor, group: Any = None) -> None:
        """An all_reduce the script called: during discovery, tells hand-written gradient sync apart, and
        over which group each tensor was reduced (a hand-written layout's data-parallel group)."""
        if not self.discovering:
            return
        if self.depth > 0:
            if group is not None:
                self.forward_groups.add(group)  # inside a forward, over a sub-group: model parallelism by hand
        elif len(self.reduced_ptrs) < 100_000:
            # Outside a forward only: an activation all-reduced in the forward is freed by the end of the
            # step, and a gradient allocated at its address would be taken for one reduced over its group
            # (seen: a flattened-buffer loop with TP layers inferred the TP group as data-parallel).
            self.reduced_ptrs[tensor.data_ptr()] = group

    def blind(self, watchers: list[str], step: int) -> tuple[str, str] | None:
        """At the end of discovery: (message, fix) when no model was found and ``watchers`` (the detectors
        that need one) would watch nothing; None otherwise."""
        if self.roots or not watchers:
            return None
        return (f"no model was found in step {step} (no module ran forward before its optimizer step): "
                f"{', '.join(watchers)} watch nothing in this run",
                "call distdebug.watch(model, optimizer) once they are built; or look for an optimizer.step() before "
                "the first forward (a helper that steps once to create the optimizer's state)")

    def describe(self, ctx: RankContext, step_source: str | None) -> dict[str, Any]:
        """What was found, described; the models and the layout set on ``ctx``, its ``discovery`` too."""
        grad_ptrs = set()
        roots = self.roots
        for root in roots:
            for p in root.parameters():
                if p.grad is not None:
                    grad_ptrs.add(p.grad.data_ptr())
        manual = bool(self.reduced_ptrs.keys() & grad_ptrs)
        # The groups the script all-reduced gradients over by hand, with how many gradients each
        grad_groups: dict[Any, int] = {}
        for ptr in self.reduced_ptrs.keys() & grad_ptrs:
            group = self.reduced_ptrs[ptr]
            grad_groups[group] = grad_groups.get(group, 0) + 1
        self.reduced_ptrs = {}
        models = []
        ctx.models = roots
        discovery.mark_compiled(roots)
        for root in roots:
            try:
                models.append(discovery.describe_model(root, manual_grad_collectives=manual))
            except Exception as e:  # a strange module must not break discovery of the others
                models.append({"class": type(root).__name__, "error": repr(e)})
        optimizers = []
        for opt in ctx.optimizers:
            try:
                optimizers.append(discovery.describe_optimizer(opt))
            except Exception as e:
                optimizers.append({"class": type(opt).__name__, "error": repr(e)})
        rank, world = ctx.identity.rank, ctx.identity.world_size
        try:
            ctx.layout = layout_mod.find_layout(roots, rank, world, grad_groups=grad_groups,
                                                forward_groups=self.forward_groups)
            self.forward_groups = set()
            described = ctx.layout.describe()
        except Exception as e:  # an unknown layout: checks compare as in plain data parallelism
            ctx.layout = layout_mod.Layout(rank=rank, world=world)
            described = {"label": None, "error": repr(e)}
        info = {
            "models": models,
            "layout": described,
            "optimizers": optimizers,
            "loss_modules": self.loss_modules,
            "process_group": discovery.describe_process_group(),
            "step_source": step_source,
        }
        ctx.discovery = info
        return info

    def trained_parameters(self, ctx: RankContext) -> Iterator[Any]:
        """The parameters of the models found and of the optimizers stepped (each may miss some)."""
        for root in self.roots:
            yield from root.parameters()
        for opt in ctx.optimizers:
            for group in getattr(opt, "param_groups", ()):
                yield from group.get("params", ())

    def end_hooks(self, closed: bool) -> None:
        # Forward hooks are only for discovery; removing them restores nn.Module's fast path. Not when a
        # model runs compiled: its graphs were traced with the global hooks there (inert while
        # compiling), and removing them would recompile every graph once. They stay, inert.
        if not self.discovering and discovery.any_compiled() and not closed:
            self.inert = True
            return
        for h in self.handles:
            h.remove()
        self.handles = []

    def forget_roots(self) -> None:
        """A new phase: the models found are the old phase's."""
        self.root_refs = []

    def restart(self) -> None:
        """The next step discovers again (a new phase), as the first step did."""
        self.loss_modules, self.reduced_ptrs, self.forward_groups = [], {}, set()
        self.discovering = True
        if self.inert:
            self.inert = False  # a compiled model's: the hooks stayed, inert
        elif not self.handles:
            self.install_hooks()
