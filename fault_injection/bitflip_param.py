"""bitflip_param: one bit of one parameter element flips on one rank (silent data corruption).

No NaN, no error: the replica simply differs from the others from that step on, which only a
cross-rank comparison of the parameters (replica_divergence) can see. The bit flips right after the
step's optimizer update (a per-optimizer post-hook, which runs before the session's global one that
ends the step), so that step's boundary is the first to differ. Flipping then, rather than as the
forward starts, hits the tensor the optimizer keeps: under FSDP2 the forward runs on a gathered copy
that is freed after it, and a flip there would be averaged away.

In a layout where ranks are not all replicas (tensor parallel, 2-D meshes), the flip is recorded with
its tensor's replica group (the ranks that hold the same shard), which is where it must be found. Where
nobody else holds the tensor (FSDP2 sharding over every rank), no comparison can see a flip: the fault
does not flip and says so.

The training can undo a flip: DeepSpeed ZeRO steps its own fp32 copy of the parameters and copies its
partition back into them (then all-gathers them) after the optimizer's step, over the flipped word. So
the flipped word is read again at the step's end, with the step's one device-to-host read (``probe``),
and a flip that did not survive is said (``not_acted``), not left to read as the detector's miss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext, StepEvent

from ._targets import local, parameter
from .base import RANK, STEP, Expect, Fault, Param

if TYPE_CHECKING:
    from .facts import Facts


class BitflipParam(Fault):
    name = "bitflip_param"
    description = "one bit of one parameter element flips on one rank (silent data corruption)"
    param: str
    bit: int
    params = (RANK, STEP, Param("param", str, "", "parameter name (default: the last weight)"),
              Param("bit", int, 20, "bit of the first element's float32 word (0-31)"))
    aims = (0, "param")
    catcher = "replica_divergence"
    engines = ("ddp", "manual", "ddp_tp", "hsdp_tp", "pp_dp")
    rerun_on = ("ddp", "manual")
    """Recipes whose replay also runs it under ``--rerun-on-anomaly``: the flipped rank re-executes the step
    and calls it a stored corruption (the step's computation reproduces; the stored value stays wrong)."""

    acts_through = "a torch optimizer's step() on its rank, after which a float32 parameter's bit flips"
    flipped: tuple[str, Any, Any] | None = None
    """(name, parameter, the word written) until the step's end reads the word again."""

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        if not self.mine():
            return
        if not ctx.optimizers:
            self.not_acted("no optimizer was found: no update to flip a parameter's bit after")
            return
        if not callable(getattr(ctx.optimizers[0], "register_step_post_hook", None)):
            self.not_acted(f"the optimizer ({type(ctx.optimizers[0]).__name__}) takes no step post-hook: no "
                           "moment after its update to flip a bit at")
            return
        # guarded: an error of the fault's own switches it off and is reported, never raised into the step
        ctx.optimizers[0].register_step_post_hook(self.guarded(self._post))
        self.acts_through = (f"{type(ctx.optimizers[0]).__name__}.step() in step {self.step}, after which a bit flips: "
                             "it did not run then")

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.here():
            return
        import torch

        found = parameter(self.ctx, self.param) if self.ctx is not None else None
        if found is None:
            self.not_acted(f"the model has no parameter named {self.param}" if self.param
                           else "the model has no parameter that requires a gradient")
            return
        name, p = found
        if p.dtype != torch.float32:
            self.not_acted(f"{name} is {str(p.dtype).replace('torch.', '')}, not float32: bit {self.bit} is a "
                           "bit of a float32 word")
            return
        layout = getattr(self.ctx, "layout", None)
        group = layout.replicas(p) if layout is not None else None
        if group is False:  # nobody else holds this tensor: no comparison can see a flip in it
            self.not_acted(_alone(name, p, layout))
            return
        with torch.no_grad():
            word = local(p).view(-1)[:1].view(torch.int32)
            word.bitwise_xor_(1 << self.bit)
            self.flipped = (name, p, word.clone())  # a device copy: read with the step's values, at its end
        self.injected(param=name, bit=self.bit, replicas=group, rerun=_rerun_records())

    def probe(self, step: int) -> dict[str, Any] | None:
        """At the end of the flip's step: whether the flipped word still holds what was written (1) or was
        written again since (0), compared on the device."""
        if self.flipped is None:
            return None
        import torch

        _, p, written = self.flipped
        with torch.no_grad():
            now = local(p).view(-1)[:1].view(torch.int32)
            return {"kept": (now == written).all()}

    def on_step(self, event: StepEvent) -> tuple[()]:
        if event.skipped and event.step == self.step and self.mine() and not self.acted:
            self.not_acted(f"step {self.step}'s update was skipped by the loss scaler (its gradients were not "
                           "finite): no update to flip a bit after")
        if self.flipped is not None:
            name, _, _ = self.flipped
            self.flipped = None
            kept = self.values(event).get("kept")
            if kept is not None and not kept:
                self.not_acted(f"the flipped bit in {name} did not survive step {event.step}: the value was "
                               f"rewritten before the step ended ({_rewriter(getattr(self.ctx, 'layout', None))})")
        return super().on_step(event)

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.optimizers or not facts.param:
            return "no model and optimizer were found: no parameter to flip a bit in"
        if facts.replicas < 2:
            return "no two ranks hold the same parameters: nothing to compare a flipped bit with"
        # Whether another rank holds the parameter's values, from the layout in the clean run (FSDP2's full
        # shard: nobody; HSDP: its replica group); ZeRO-3's partitions are plain tensors the layout cannot
        # see into. ZeRO-1/2 replicate the parameters: replayed (the fault says whether its flip survived).
        unreplicated = facts.replicas_of_param()
        if unreplicated:
            return unreplicated + ": a flipped bit has nothing to be compared with"
        if (facts.zero_stage or 0) >= 3:
            return ("DeepSpeed ZeRO-3 partitions every parameter across the ranks: no other rank holds the values "
                    "a flipped bit would be compared with")
        if "fsdp2" in facts.wrappers and not facts.param_replicas:  # a probe that did not ask the layout
            return f"not replayed under sharded parameters ({facts.wrapper_names}): each rank holds its own shard"
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        # Found among the ranks that hold the same tensor (every rank unless the layout says fewer).
        # With two of them nobody can say which one is right: both are named.
        out = []
        for i in injected:
            group = i.get("replicas") or list(range(world))
            out.append(Expect("replica_divergence", ranks=[i["rank"]] if len(group) > 2 else group,
                              step=i["step"], subject=i["param"]))
            if i.get("rerun"):  # under --rerun-on-anomaly: the flipped rank says what kind of fault it was
                out.append(Expect("rerun", ranks=[i["rank"]], step=i["step"],
                                  evidence={"verdict": "stored corruption", "tensor": i["param"]}))
        return out


def _alone(name: str, p: Any, layout: Any) -> str:
    """Why nobody else holds ``p``, named from its placements and the layout."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None:
        try:
            ranks = [int(r) for r in mesh.mesh.flatten().tolist()]  # the mesh's rank table, a CPU tensor
        except Exception:  # a mesh of another shape: said without its ranks
            ranks = []
        by = "FSDP2" if getattr(layout, "dp_wrapper", None) == "fsdp2" else "tensor parallelism"
        over = f"over ranks {ranks} " if ranks else ""
        return f"no other rank holds {name} (sharded {over}by {by}), so a flip has nothing to be compared with"
    label = layout.label() if layout is not None and callable(getattr(layout, "label", None)) else ""
    return f"no other rank holds {name}{f' ({label})' if label else ''}, so a flip has nothing to be compared with"


def _rewriter(layout: Any) -> str:
    """Who writes a parameter again after the optimizer's step, as far as the layout tells."""
    if getattr(layout, "dp_wrapper", None) == "deepspeed":
        return ("DeepSpeed ZeRO steps its own fp32 copy of the parameters and copies its partition back into them "
                "after the optimizer step")
    return "something after the optimizer's step wrote the parameter again: the script, or the framework it uses"


def _rerun_records() -> bool:
    """This rank captures its steps for re-execution (attach --rerun-on-anomaly, a model it can re-run)."""
    from distdebug.runtime.session import current_session

    session = current_session()
    return session is not None and any(d.name == "rerun" and getattr(d, "recorders", None) and not d.off
                                       for d in session.detectors)
