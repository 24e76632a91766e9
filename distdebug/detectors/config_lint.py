"""ConfigLint: ``distdebug lint``'s checks on the real objects, inside attach (after step 1).

What the source cannot show, the live objects do:
- DDP ``find_unused_parameters=True``: which parameters really got no gradient in step 1. None
  -> the per-step graph walk is wasted (warning); some -> they are named (info: keep the flag or
  fix the model).
- DDP ``broadcast_buffers=False`` with plain BatchNorm modules (named).
- ``torch.compile`` applied before the DDP wrap (DDP wraps an OptimizedModule).
- DDP bucket size against the model: one bucket for a model of BIG_MODEL bytes or more (backward
  cannot overlap communication), or more than MANY_BUCKETS buckets (per-collective overhead).
- DeepSpeed: ``zero_grad()`` between ``engine.backward()`` and ``engine.step()`` (the step then applies
  nothing), seen as it happens, with the step.

Not here: static_graph with data-dependent branches (only the source shows the branch),
DistributedSampler.set_epoch (data_order), BatchNorm statistics that diverge (bn_divergence).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from distdebug.detectors.base import Detector, Finding, Severity, StepEvent

BIG_MODEL = 100 << 20
MANY_BUCKETS = 1000


class ConfigLint(Detector):
    name = "config_lint"
    description = "lint's checks on the live DDP/DeepSpeed objects (unused parameters, buffers, wrap order, buckets)"

    def __init__(self) -> None:
        self.ctx: Any = None
        self.step = 1
        self.reported: set[str] = set()

    def attach(self, ctx: Any) -> None:
        from distdebug.runtime.discovery import is_deepspeed_engine, unwrap

        self.ctx = ctx
        out: list[Finding] = []
        for root in ctx.models:
            inner, chain, options = unwrap(root)
            if "ddp" in chain:
                out += self._ddp(root, inner, chain, options.get("ddp") or {})
            if is_deepspeed_engine(root):
                self._watch_engine(root)
        for f in out:
            ctx.report(f)

    def _finding(self, severity: Severity, subject: str, message: str, fix: str, **evidence: Any) -> Finding:
        return Finding(severity=severity, detector=self.name, ranks=[self.ctx.rank], step=1, subject=subject,
                       message=message, fix=fix, evidence=evidence)

    def _ddp(self, root: Any, inner: Any, chain: list[str], opts: dict[str, Any]) -> list[Finding]:
        from torch.nn.modules.batchnorm import _BatchNorm

        out = []
        if chain.index("ddp") < (chain.index("torch.compile") if "torch.compile" in chain else -1):
            out.append(self._finding(Severity.WARNING, "torch.compile before DDP",
                                     "DDP wraps a torch.compile'd module: DDP's graph-splitting optimizer for "
                                     "compiled models works when the DDP module is what gets compiled",
                                     "model = DDP(model); model = torch.compile(model)"))
        named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
        if opts.get("find_unused_parameters"):
            unused = [n for n, p in named if p.grad is None]
            if not unused:
                out.append(self._finding(Severity.WARNING, "find_unused_parameters",
                                         "DDP(find_unused_parameters=True), but every parameter got a gradient in "
                                         "step 1: the graph walk after each forward is wasted",
                                         "remove find_unused_parameters=True"))
            else:
                out.append(self._finding(Severity.INFO, "find_unused_parameters",
                                         f"{len(unused)} parameter(s) got no gradient in step 1 "
                                         f"({', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}): "
                                         "find_unused_parameters=True is "
                                         "needed as the model stands",
                                         "if they are never used, remove them and the flag", unused=unused[:50]))
        bns = [n for n, m in inner.named_modules() if isinstance(m, _BatchNorm) and type(m).__name__ != "SyncBatchNorm"]
        if opts.get("broadcast_buffers") is False and bns:
            out.append(self._finding(Severity.WARNING, "broadcast_buffers",
                                     f"DDP(broadcast_buffers=False) with BatchNorm ({', '.join(bns[:8])}): each "
                                     "rank's running statistics drift apart",
                                     "keep broadcast_buffers=True, or convert to SyncBatchNorm", modules=bns))
        cap = int(opts.get("bucket_cap_bytes") or 0)
        size = sum(p.numel() * p.element_size() for _, p in named)
        if cap > 0 and size:
            buckets = -(-size // cap)
            if buckets == 1 and size >= BIG_MODEL:
                out.append(self._finding(Severity.WARNING, "bucket_cap_mb",
                                         f"the whole model ({size / 2**20:.0f} MB) fits in one {cap / 2**20:.0f} MB "
                                         "DDP bucket: its all-reduce starts only when backward ends",
                                         "a bucket_cap_mb of about a tenth of the model", model_bytes=size,
                                         bucket_bytes=cap))
            elif buckets > MANY_BUCKETS:
                out.append(self._finding(Severity.WARNING, "bucket_cap_mb",
                                         f"{buckets} DDP buckets of {cap / 2**20:.2g} MB for a {size / 2**20:.0f} MB "
                                         "model: per-collective overhead dominates",
                                         "bucket_cap_mb 25 (PyTorch's default) or more", model_bytes=size,
                                         bucket_bytes=cap))
        return out

    def _watch_engine(self, engine: Any) -> None:
        """zero_grad between backward and step, caught as it happens."""
        det = self
        state = {"after_backward": False}
        backward, step, zero_grad = engine.backward, engine.step, engine.zero_grad

        def wrapped_backward(*args: Any, **kwargs: Any) -> Any:
            out = backward(*args, **kwargs)
            state["after_backward"] = True
            return out

        def wrapped_step(*args: Any, **kwargs: Any) -> Any:
            state["after_backward"] = False  # the engine zeroes gradients inside step() itself
            return step(*args, **kwargs)

        def wrapped_zero_grad(*args: Any, **kwargs: Any) -> Any:
            if state["after_backward"] and "ds_zero_grad" not in det.reported:
                det.reported.add("ds_zero_grad")
                det.ctx.report(Finding(
                    severity=Severity.ERROR, detector=det.name, ranks=[det.ctx.rank], step=det.step,
                    subject="engine.zero_grad",
                    message=f"zero_grad() between engine.backward() and engine.step() in step {det.step}: the "
                            "step that follows applies no gradient",
                    fix="remove it: engine.step() zeroes the gradients itself"))
            return zero_grad(*args, **kwargs)

        self.ctx.patch(engine, "backward", wrapped_backward)
        self.ctx.patch(engine, "step", wrapped_step)
        self.ctx.patch(engine, "zero_grad", wrapped_zero_grad)

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        self.step = event.step + 1
        return ()
