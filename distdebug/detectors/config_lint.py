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
- ``torch.nn.utils.clip_grad_norm_`` on FSDP1's sharded parameters (each rank clips by the norm of
  its own shard), seen as it happens, with the step and the local norm it returned.

Not here: static_graph with data-dependent branches (only the source shows the branch),
DistributedSampler.set_epoch (data_order), BatchNorm statistics that diverge (bn_divergence).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Iterable
from typing import Any

from distdebug.cards.config_lint import CARD
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity

BIG_MODEL = 100 << 20
MANY_BUCKETS = 1000


FIND_UNUSED_FIX = {
    "transformers": "TrainingArguments(ddp_find_unused_parameters=False) (the Trainer turns it on itself when it "
                    "is not set)",
    "accelerate": "Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)]) "
                  "(from accelerate.utils)",
    "lightning": "Trainer(strategy='ddp') rather than 'ddp_find_unused_parameters_true', or "
                 "DDPStrategy(find_unused_parameters=False)",
}
"""The fix for a needless find_unused_parameters=True, by the framework that built the DDP wrapper (the
script never wrote the flag: telling it to remove it sends the user looking for a line that is not there)."""
FIND_UNUSED_FIX["pytorch_lightning"] = FIND_UNUSED_FIX["lightning_fabric"] = FIND_UNUSED_FIX["lightning"]


class ConfigLint(Detector):
    name = "config_lint"
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    def __init__(self) -> None:
        self.ctx: RankContext | None = None
        self.step = 1
        self.reported: set[str] = set()
        self.checkpoint_calls = 0
        # the first parameter of each set clip_grad_norm_ was given and that was looked at (weakly: never kept;
        # a tensor's == is elementwise, so by id, confirmed by the reference)
        self.clipped: dict[int, weakref.ref[Any]] = {}
        self.pending: list[Finding] = []
        """Findings noted before attach (while ranks and steps are not known yet), reported at attach."""

    def setup(self, ctx: RankContext) -> None:
        """Watch torch.nn.utils.clip_grad_norm_ from the script's first line (clipping in step 1 counts)."""
        self.ctx = ctx
        import torch.utils.checkpoint as checkpoint_module
        from torch.nn.parallel import DistributedDataParallel

        self.patch(ctx, DistributedDataParallel, "__init__", self._note_ddp_args)
        self.patch(ctx, checkpoint_module, "checkpoint", self._count_checkpoint)
        self.patch_clip_grad_norm(ctx, self._wrap_clip)

    def _note_ddp_args(self, original: Any) -> Any:
        """DDP's device_ids/output_device as the script passed them: DDP keeps no trace of an output_device
        it ignores (a CPU or multi-device module, or no device_ids), so only the call shows the mistake."""
        det = self

        @functools.wraps(original)
        def __init__(ddp: Any, module: Any, device_ids: Any = None, output_device: Any = None, *args: Any,
                     **kwargs: Any) -> None:
            original(ddp, module, device_ids, output_device, *args, **kwargs)
            if output_device is None:
                return
            if not device_ids:
                det.pending.append(det._finding(
                    Severity.WARNING, "output_device",
                    f"DDP(output_device={output_device!r}) without device_ids: DDP ignores it (it applies only to "
                    "a single-device GPU module given device_ids); outputs stay where the module computed them",
                    "DDP(model, device_ids=[local_rank], output_device=local_rank) on GPU, neither on CPU"))
            elif len(device_ids) == 1 and str(output_device) != str(device_ids[0]):
                det.pending.append(det._finding(
                    Severity.WARNING, "output_device",
                    f"DDP(device_ids={list(device_ids)!r}, output_device={output_device!r}): every forward's output "
                    "is copied to another GPU than the one that computed it",
                    "output_device = device_ids[0] = local_rank (or leave output_device out)"))

        return __init__

    def _count_checkpoint(self, original: Any) -> Any:
        """Counts activation-checkpoint calls (offload_param with checkpointing); passes everything through."""
        det = self

        def checkpoint(*args: Any, **kwargs: Any) -> Any:
            det.checkpoint_calls += 1
            return original(*args, **kwargs)

        return checkpoint

    def _wrap_clip(self, original: Any) -> Any:
        """clip_grad_norm_ on FSDP1 parameters: each rank's norm of its own shard, not the model's.

        FSDP1 marks the parameters it flattens (FlatParameters, and the original parameters' views under
        use_orig_params=True) with ``_fsdp_flattened``; FSDP2's DTensor parameters are not marked, and
        torch's clip computes their global norm correctly. The parameters are listed once (a generator
        could be iterated only once) and handed on unchanged: the result is the original's. A set of
        parameters is looked at once, told by its first parameter (how a model is wrapped does not change
        while it trains): after that the call goes straight through (issue 18: listing a model's
        parameters at every step cost 0.2 ms on the GPT recipe).
        """
        det = self
        ctx = self.ctx
        assert ctx is not None  # set in setup(), before this patch

        def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            import torch

            if not isinstance(parameters, torch.Tensor):
                it = iter(parameters)
                first = next(it, None)
                seen = det.clipped.get(id(first)) if first is not None else None
                if first is None or (seen is not None and seen() is first):
                    # these parameters were looked at: straight through (the generator as it was)
                    return original(parameters if first is None else itertools.chain((first,), it), *args,
                                    **kwargs)
                if len(det.clipped) >= 64:
                    det.clipped.clear()
                det.clipped[id(first)] = weakref.ref(first)
                parameters = [first, *it]
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            norm = original(params, *args, **kwargs)
            if "fsdp1_clip" not in det.reported and any(getattr(p, "_fsdp_flattened", False) for p in params):
                det.reported.add("fsdp1_clip")
                ctx.report(Finding(
                    severity=Severity.ERROR, detector=det.name, ranks=[ctx.rank], step=det.step,
                    subject="clip_grad_norm_ on FSDP1",
                    message=f"torch.nn.utils.clip_grad_norm_ on FSDP1's sharded parameters in step {det.step}: it "
                            f"returned {float(norm):.6g}, the norm of this rank's shard only, so every rank clips "
                            "by a different, too small norm",
                    fix="model.clip_grad_norm_(max_norm) (FSDP1's own: all-reduces the shards' norms), or FSDP2",
                    evidence={"local_norm": float(norm)}))
            return norm

        return clip_grad_norm_

    def attach(self, ctx: RankContext) -> None:
        from distdebug.runtime.discovery import is_deepspeed_engine, unwrap

        self.ctx = ctx
        out: list[Finding] = self.pending
        self.pending = []
        for root in ctx.models:
            inner, chain, options = unwrap(root)
            if "ddp" in chain:
                out += self._ddp(root, inner, chain, options.get("ddp") or {})
            if is_deepspeed_engine(root):
                self._watch_engine(root)
                out += self._engine_config(root)
        for f in out:
            ctx.report(f)

    def _finding(self, severity: Severity, subject: str, message: str, fix: str, **evidence: Any) -> Finding:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        return Finding(severity=severity, detector=self.name, ranks=[ctx.rank], step=1, subject=subject,
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
            from distdebug.runtime.discovery import ddp_builder, find_ddp

            ddp = find_ddp(root)
            builder = ddp_builder(ddp) if ddp is not None else None
            if not unused:
                by = f" (set by {builder}, which built the DDP wrapper)" if builder else ""
                # A flag the script set (its own DDP, accelerate's DistributedDataParallelKwargs, Lightning's
                # strategy) is its mistake to fix: a warning. The HF Trainer turns it on by itself for its
                # models (ddp_find_unused_parameters=None): a note of what that costs, and the Trainer's knob.
                severity = Severity.INFO if builder == "transformers" else Severity.WARNING
                out.append(self._finding(severity, "find_unused_parameters",
                                         f"DDP(find_unused_parameters=True){by}, but every parameter got a gradient "
                                         "in step 1: the graph walk after each forward is wasted",
                                         FIND_UNUSED_FIX.get(builder or "", "remove find_unused_parameters=True"),
                                         built_by=builder or "the script"))
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

    def _engine_config(self, engine: Any) -> list[Finding]:
        """The live engine's settings (after DeepSpeed resolved the config): offload with activation
        checkpointing, fp16 with a fixed loss scale."""
        out = []
        try:
            offload = engine.zero_offload_param()
        except Exception:
            offload = None
        device = str(getattr(offload, "device", "none") or "none").split(".")[-1].lower()
        ac = getattr(getattr(engine, "_config", None), "activation_checkpointing_config", None)
        configured = [k for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
                      if getattr(ac, k, False)]
        if offload is not None and device not in ("none", "") and (configured or self.checkpoint_calls):
            how = f"activation_checkpointing {', '.join(configured)}" if configured else \
                f"torch.utils.checkpoint ({self.checkpoint_calls} calls in step 1)"
            out.append(self._finding(Severity.WARNING, "offload_param with activation checkpointing",
                                     f"ZeRO-3 offload_param to {device} together with {how}: the recomputation in "
                                     "backward fetches the offloaded parameters again (slow, and a known source of "
                                     "failures)",
                                     "keep offload_param off while checkpointing activations, or offload only the "
                                     "optimizer (offload_optimizer)", offload_device=device))
        try:
            fp16, dynamic = engine.fp16_enabled(), engine.dynamic_loss_scale()
        except Exception:
            fp16, dynamic = False, True
        if fp16 and not dynamic:
            scale = float(engine.loss_scale())
            out.append(self._finding(Severity.WARNING, "fp16 static loss scale",
                                     f"fp16 with a fixed loss scale of {scale:g}: gradients that overflow make "
                                     "inf/NaN steps, ones that underflow vanish; nothing adapts the scale",
                                     "fp16 loss_scale 0 (dynamic, DeepSpeed's default), or bf16", loss_scale=scale))
        return out

    def _watch_engine(self, engine: Any) -> None:
        """zero_grad between backward and step, caught as it happens."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        det = self
        state = {"after_backward": False}

        def make_backward(backward: Any) -> Any:
            def wrapped_backward(*args: Any, **kwargs: Any) -> Any:
                out = backward(*args, **kwargs)
                state["after_backward"] = True
                return out
            return wrapped_backward

        def make_step(step: Any) -> Any:
            def wrapped_step(*args: Any, **kwargs: Any) -> Any:
                state["after_backward"] = False  # the engine zeroes gradients inside step() itself
                return step(*args, **kwargs)
            return wrapped_step

        def make_zero_grad(zero_grad: Any) -> Any:
            def wrapped_zero_grad(*args: Any, **kwargs: Any) -> Any:
                check_zero_grad()
                return zero_grad(*args, **kwargs)
            return wrapped_zero_grad

        def check_zero_grad() -> None:
            if state["after_backward"] and "ds_zero_grad" not in det.reported:
                det.reported.add("ds_zero_grad")
                ctx.report(Finding(
                    severity=Severity.ERROR, detector=det.name, ranks=[ctx.rank], step=det.step,
                    subject="engine.zero_grad",
                    message=f"zero_grad() between engine.backward() and engine.step() in step {det.step}: the "
                            "step that follows applies no gradient",
                    fix="remove it: engine.step() zeroes the gradients itself"))

        self._watch_saves(engine)
        self.patch(ctx, engine, "backward", make_backward)
        self.patch(ctx, engine, "step", make_step)
        self.patch(ctx, engine, "zero_grad", make_zero_grad)

    def _watch_saves(self, engine: Any) -> None:
        """torch.save of the engine's model state instead of engine.save_checkpoint, seen as it happens.

        A saved mapping whose keys name most of the engine's parameters (``engine.state_dict()``,
        ``engine.module.state_dict()``) is the engine's state; saves made by save_checkpoint itself
        (DeepSpeed writes its files with torch.save) are not counted.
        """
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        import torch

        det = self
        names = [n for n, _ in engine.module.named_parameters()]
        inside = {"depth": 0}

        def make_save_checkpoint(save_checkpoint: Any) -> Any:
            def wrapped_save_checkpoint(*args: Any, **kwargs: Any) -> Any:
                inside["depth"] += 1
                try:
                    return save_checkpoint(*args, **kwargs)
                finally:
                    inside["depth"] -= 1
            return wrapped_save_checkpoint

        def make_torch_save(torch_save: Any) -> Any:
            def wrapped_torch_save(obj: Any, *args: Any, **kwargs: Any) -> Any:
                check_save(obj)
                return torch_save(obj, *args, **kwargs)
            return wrapped_torch_save

        def check_save(obj: Any) -> None:
            if not inside["depth"] and "ds_torch_save" not in det.reported and names and isinstance(obj, dict):
                # Every dotted tail of every key ("module.0.weight" -> "0.weight", "weight"): one pass,
                # not names x keys, which a model of thousands of parameters would pay at each save.
                tails: set[str] = set()
                for k in obj:
                    parts = str(k).split(".")
                    tails.update(".".join(parts[i:]) for i in range(len(parts)))
                held = sum(1 for n in names if n in tails)
                if held * 2 >= len(names):
                    det.reported.add("ds_torch_save")
                    stage = engine.zero_optimization_stage()
                    after = det.step - 1  # saves come after a step's step(): the checkpoint of that step
                    ctx.report(Finding(
                        severity=Severity.WARNING, detector=det.name, ranks=[ctx.rank], step=after or None,
                        subject="torch.save of engine state",
                        message="torch.save of the DeepSpeed engine's model state "
                                + (f"after step {after}" if after else "before the first step") + " (ZeRO stage "
                                f"{stage}): the optimizer's partitioned state, the loss scaler and the scheduler are "
                                "not in it" + (", and under ZeRO-3 neither are the parameters (each rank holds a "
                                               "partition)" if stage == 3 else ""),
                        fix="engine.save_checkpoint(dir, tag) and engine.load_checkpoint(dir, tag); for a plain "
                            "model file, zero_to_fp32 after saving the checkpoint",
                        evidence={"parameters_named": held, "zero_stage": stage}))

        self.patch(ctx, engine, "save_checkpoint", make_save_checkpoint)
        self.patch(ctx, torch, "save", make_torch_save)

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        self.step = event.step + 1
        return ()
