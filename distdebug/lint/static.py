"""``distdebug lint SCRIPT``: DDP, FSDP and DeepSpeed pitfalls read from the source (nothing is run).

Each rule follows what PyTorch and DeepSpeed really do, shown by tests where folklore says
otherwise: in-place clipping after backward is fine with gradient_as_bucket_view
(only ``detach_()`` on gradients is not); clip_grad_norm_ after DDP needs no rescaling by the world
size (every rank holds the same averaged gradient; tests/dist/test_lint_claims.py shows it); after
``engine.step()`` an extra ``zero_grad()`` is only redundant, zeroing between ``engine.backward()``
and ``engine.step()`` is the real bug.

Names are resolved through the file's imports (``DistributedDataParallel as DDP``), so aliases are
seen; anything built dynamically is not (this is a reading of the source, not of the objects).
"""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ERROR, WARN, INFO = "error", "warning", "info"
DDP_NAMES = {"DistributedDataParallel"}
FSDP1_NAMES = {"FullyShardedDataParallel"}
TENSOR_PREDICATES = {"item", "any", "all", "sum", "max", "min", "mean", "norm", "isnan", "isinf", "nonzero"}


@dataclass(frozen=True)
class LintFinding:
    rule: str
    severity: str
    line: int
    message: str
    why: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    return ""


def _const(node: ast.AST | None) -> Any:
    try:
        return ast.literal_eval(node) if node is not None else None
    except (ValueError, SyntaxError):
        return None


class _Source:
    """What the rules look at: calls with their resolved names, assignments, the import aliases."""

    def __init__(self, tree: ast.AST) -> None:
        self.aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = a.name.split(".")[-1]
        self.calls: list[ast.Call] = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        self.names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        self.tree = tree

    def name(self, call: ast.Call) -> str:
        """The called function's own name, aliases resolved (``DDP`` -> ``DistributedDataParallel``)."""
        dotted = _dotted(call.func)
        last = dotted.split(".")[-1]
        return self.aliases.get(last, last) if "." not in dotted else last

    def receiver(self, call: ast.Call) -> str:
        return _dotted(call.func.value) if isinstance(call.func, ast.Attribute) else ""

    def calls_named(self, *names: str) -> list[ast.Call]:
        return [c for c in self.calls if self.name(c) in names]

    def mentions(self, fragment: str) -> bool:
        return any(fragment in self.aliases.get(n, n) for n in self.names)


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _rules(src: _Source) -> list[LintFinding]:
    out: list[LintFinding] = []
    add = out.append
    ddps = [c for c in src.calls if src.name(c) in DDP_NAMES]
    for c in ddps:
        if _const(_kw(c, "find_unused_parameters")) is True:
            add(LintFinding("ddp-find-unused-parameters", WARN, c.lineno,
                            "DDP(find_unused_parameters=True)",
                            "DDP then walks the autograd graph after every forward to find parameters without a "
                            "gradient: a cost each step, needed only when some parameters really get none",
                            "remove it; if DDP then errors about unused parameters, fix the model (or keep it); "
                            "under attach, the discovery record shows which parameters got no gradient"))
        bb = _kw(c, "broadcast_buffers") or _kw(c, "forward_sync_buffers")
        if _const(bb) is False and src.mentions("BatchNorm"):
            add(LintFinding("ddp-broadcast-buffers-batchnorm", WARN, c.lineno,
                            "DDP(broadcast_buffers=False) in a model with BatchNorm",
                            "each rank's running_mean/running_var then drift apart, so evaluation and checkpoints "
                            "differ by rank (attach's bn_divergence shows it)",
                            "keep broadcast_buffers=True, or convert to SyncBatchNorm"))
        if _const(_kw(c, "output_device")) is not None and _kw(c, "device_ids") is None:
            add(LintFinding("ddp-output-device", WARN, c.lineno, "DDP(output_device=...) without device_ids",
                            "output_device only applies to single-device modules given device_ids; otherwise "
                            "outputs stay where the module computed them, or are copied to one device",
                            "DDP(model, device_ids=[local_rank], output_device=local_rank), or neither"))
        cap = _const(_kw(c, "bucket_cap_mb"))
        if isinstance(cap, (int, float)) and not isinstance(cap, bool) and not 1 <= cap <= 512:
            add(LintFinding("ddp-bucket-cap-mb", WARN, c.lineno, f"DDP(bucket_cap_mb={cap})",
                            "tiny buckets mean many small all-reduces (each pays a fixed latency); huge buckets "
                            "mean the all-reduce starts only when backward is nearly over (no overlap). The "
                            "default 25 MB suits most models",
                            "leave the default, or tune between 1 and a few hundred MB; under attach, config_lint "
                            "checks the real bucket count against the real model size"))
        if _const(_kw(c, "gradient_as_bucket_view")) is True:
            for d in src.calls:
                if isinstance(d.func, ast.Attribute) and d.func.attr == "detach_" and ".grad" in \
                        f".{_dotted(d.func.value)}":
                    add(LintFinding("ddp-bucket-view-detach", ERROR, d.lineno,
                                    "detach_() on a gradient with DDP(gradient_as_bucket_view=True)",
                                    "the gradients are views into DDP's buckets; PyTorch documents that detach_() "
                                    "on them is not allowed (in-place clipping after backward is fine)",
                                    "zero gradients with optimizer.zero_grad(set_to_none=True), not "
                                    "p.grad.detach_()"))
        if _const(_kw(c, "static_graph")) is True:
            for line in _data_dependent_branches(src.tree):
                add(LintFinding("ddp-static-graph-control-flow", WARN, line,
                                "DDP(static_graph=True) with a data-dependent branch in forward",
                                "static_graph assumes the same parameters are used every iteration; a branch on "
                                "tensor values can change that and break gradient synchronisation",
                                "drop static_graph, or make the branch independent of the data"))
    compiled = {t.id for n in ast.walk(src.tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                and src.name(n.value) == "compile" for t in n.targets if isinstance(t, ast.Name)}
    for c in ddps:
        if c.args and isinstance(c.args[0], ast.Name) and c.args[0].id in compiled or \
                c.args and isinstance(c.args[0], ast.Call) and src.name(c.args[0]) == "compile":
            add(LintFinding("compile-before-ddp", WARN, c.lineno, "torch.compile applied before the DDP wrap",
                            "DDP's optimizer for compiled graphs splits them at bucket boundaries only when the "
                            "DDP module is what gets compiled",
                            "model = DDP(model); model = torch.compile(model)"))
    if ddps and src.mentions("BatchNorm") and not src.mentions("SyncBatchNorm") \
            and not src.calls_named("convert_sync_batchnorm"):
        add(LintFinding("batchnorm-not-synced", INFO, ddps[0].lineno,
                        "BatchNorm under DDP without SyncBatchNorm",
                        "each rank normalises with its own batch's statistics: fine for large per-rank batches, "
                        "noisy and rank-dependent for small ones",
                        "model = nn.SyncBatchNorm.convert_sync_batchnorm(model) before DDP (GPU)"))
    samplers = src.calls_named("DistributedSampler")
    if samplers and not any(isinstance(c.func, ast.Attribute) and c.func.attr == "set_epoch" for c in src.calls):
        add(LintFinding("sampler-set-epoch", WARN, samplers[0].lineno, "DistributedSampler without set_epoch",
                        "with shuffle=True every epoch then repeats the first epoch's order",
                        "sampler.set_epoch(epoch) at the start of each epoch"))
    if any(src.name(c) in FSDP1_NAMES for c in src.calls):
        for c in src.calls:
            if src.name(c) == "clip_grad_norm_" and not (isinstance(c.func, ast.Attribute) and
                                                         src.receiver(c).split(".")[-1] not in ("utils", "nn")):
                add(LintFinding("fsdp1-clip-grad-norm", ERROR, c.lineno,
                                "torch.nn.utils.clip_grad_norm_ on an FSDP1 model",
                                "FSDP1's gradients are local shards: the norm is this rank's part only, so each "
                                "rank clips by a different factor",
                                "model.clip_grad_norm_(max_norm) (FSDP1's own, which all-reduces the norm)"))
    for c in src.calls_named("clip_grad_norm_"):
        max_norm = c.args[1] if len(c.args) > 1 else _kw(c, "max_norm")
        if max_norm is not None and any(isinstance(n, ast.Name) and "world" in n.id.lower()
                                        for n in ast.walk(max_norm)):
            add(LintFinding("clip-rescaled-by-world-size", WARN, c.lineno,
                            "clip_grad_norm_ max_norm scaled by the world size",
                            "after DDP's all-reduce every rank holds the same averaged gradient, so the norm is "
                            "already global: rescaling changes the threshold",
                            "clip_grad_norm_(model.parameters(), max_norm) with the single-GPU max_norm"))
    out += _deepspeed_rules(src)
    return out


def _data_dependent_branches(tree: ast.AST) -> list[int]:
    lines = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
            for node in ast.walk(fn):
                if isinstance(node, (ast.If, ast.While)) and any(
                        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                        and n.func.attr in TENSOR_PREDICATES for n in ast.walk(node.test)):
                    lines.append(node.lineno)
    return lines


def _deepspeed_rules(src: _Source) -> list[LintFinding]:
    out: list[LintFinding] = []
    engines = set()
    for n in ast.walk(src.tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and src.name(n.value) == "initialize" \
                and "deepspeed" in _dotted(n.value.func):
            target = n.targets[0]
            first = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
            if isinstance(first, ast.Name):
                engines.add(first.id)
    # The engine's calls in source order, the whole file at once (training loops often live at module level).
    calls = sorted((c for c in src.calls if isinstance(c.func, ast.Attribute) and _dotted(c.func.value) in engines),
                   key=lambda c: (c.lineno, c.col_offset))
    last_backward = None
    for c in calls:
        method = c.func.attr if isinstance(c.func, ast.Attribute) else ""
        if method == "backward":
            last_backward = c
        elif method == "step":
            last_backward = None
        elif method == "zero_grad" and last_backward is not None:
            out.append(LintFinding("deepspeed-zero-grad-before-step", ERROR, c.lineno,
                                   "zero_grad() between engine.backward() and engine.step()",
                                   "it clears the gradients engine.step() is about to apply: the step updates "
                                   "nothing (engine.step() zeroes them itself afterwards)",
                                   "remove it: the engine zeroes gradients in step()"))
        elif method == "zero_grad":
            out.append(LintFinding("deepspeed-zero-grad-redundant", INFO, c.lineno,
                                   "engine.zero_grad() outside backward/step",
                                   "engine.step() already zeroes gradients; this call is only redundant",
                                   "remove it"))
    for c in src.calls_named("save"):
        if "torch" in _dotted(c.func) and c.args and any(
                isinstance(n, ast.Name) and n.id in engines for n in ast.walk(c.args[0])):
            out.append(LintFinding("deepspeed-torch-save", WARN, c.lineno, "torch.save of a DeepSpeed engine's state",
                                   "with ZeRO each rank holds a partition: one torch.save of the state dict restores "
                                   "wrongly (or only rank 0's part)",
                                   "engine.save_checkpoint(dir, tag) and engine.load_checkpoint(dir, tag)"))
    for node in ast.walk(src.tree):
        cfg = _const(node) if isinstance(node, ast.Dict) else None
        keys = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "fp16")
        if not isinstance(node, ast.Dict) or not isinstance(cfg, dict) or not any(k in cfg for k in keys):
            continue
        zero = cfg.get("zero_optimization") or {}
        if isinstance(zero, dict) and zero.get("offload_param") and (
                "activation_checkpointing" in cfg or src.calls_named("checkpoint")):
            out.append(LintFinding("deepspeed-offload-param-checkpointing", WARN, node.lineno,
                                   "offload_param together with activation checkpointing",
                                   "recomputation in backward touches parameters that were offloaded to the CPU: "
                                   "slow, and reported to break with some versions",
                                   "offload the optimizer only, or test this combination on your versions"))
        fp16 = cfg.get("fp16") or {}
        if isinstance(fp16, dict) and fp16.get("enabled") and fp16.get("loss_scale", 0) not in (0, None):
            out.append(LintFinding("deepspeed-static-loss-scale", WARN, node.lineno,
                                   f"fp16 with a static loss_scale of {fp16.get('loss_scale')}",
                                   "a fixed scale overflows (skipped steps) or underflows (zero gradients) as "
                                   "gradients change during training",
                                   '"loss_scale": 0 (dynamic), with loss_scale_window and min_loss_scale'))
        tb, mb = cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu")
        ga = cfg.get("gradient_accumulation_steps", 1)
        if all(isinstance(v, int) and v > 0 for v in (tb, mb, ga)) and tb % (mb * ga):
            out.append(LintFinding("deepspeed-batch-arithmetic", ERROR, node.lineno,
                                   f"train_batch_size {tb} is not micro batch {mb} x accumulation {ga} x world size "
                                   "for any world size",
                                   "DeepSpeed requires train_batch_size = micro batch x accumulation steps x ranks "
                                   "and refuses to start otherwise",
                                   f"a train_batch_size that is a multiple of {mb * ga}, or leave one of the three "
                                   "out and let DeepSpeed derive it"))
    return out


def lint_source(text: str) -> list[LintFinding]:
    return sorted(_rules(_Source(ast.parse(text))), key=lambda f: (f.line, f.rule))


def lint_file(path: Path) -> list[LintFinding]:
    from distdebug.errors import UserError

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}", 2) from None
    try:
        return lint_source(text)
    except SyntaxError as e:
        raise UserError(f"{path}:{e.lineno}: not valid Python ({e.msg}); lint reads the source", 2) from None
