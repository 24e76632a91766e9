"""Finiteness as device flags: the one value per tensor (max |x|, or a norm) whose finiteness says whether
every value is finite, how the flags of one step are folded together, and which torch.nn modules cannot
be the first to make a NaN (so they get no hook).

Why a module of its own: every other mechanism of nan_origin (the forward watch, the local gradients,
the collectives, the state checks) records its evidence through these, never with a host read; the step's
one host read brings them all to the host, where ``all_finite`` judges them (watch.py, ``probe``)."""

from __future__ import annotations

import math
from typing import Any

import torch

INF = float("inf")

FINITE_PRESERVING_NAMES = frozenset({
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "Hardtanh", "Sigmoid", "Tanh", "Hardsigmoid", "Hardswish",
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "Identity", "Flatten", "Unflatten",
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
    "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d", "ConstantPad3d",
    "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d", "ReplicationPad2d",
    "ReplicationPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d",
    # bounded by |x| or by a constant, also in fp16/bf16: GELU, SiLU, Mish, ELU, CELU, the shrinks, Softsign,
    # GLU; Softmax and its kin subtract the maximum first; LogSigmoid is computed stably. Not SELU (its scale
    # 1.05 overflows fp16 near its maximum), Softplus (exp before its threshold), LPPool (powers).
    "GELU", "SiLU", "Mish", "ELU", "CELU", "Hardshrink", "Softshrink", "Tanhshrink", "Softsign", "GLU",
    "Softmax", "Softmin", "LogSoftmax", "Softmax2d", "LogSigmoid",
    "PixelShuffle", "PixelUnshuffle", "ChannelShuffle", "Upsample", "UpsamplingNearest2d",
    "UpsamplingBilinear2d", "FractionalMaxPool2d", "FractionalMaxPool3d",
})
"""torch.nn's parameterless modules whose output is finite whenever their input is: never the *first*
module with a non-finite output (the module before them would be), so they get no hook; every hook
costs time in every forward. Exact classes only: a subclass may compute anything."""



FINITE_GIVEN_PARAMETERS_NAMES = frozenset({
    "Embedding", "LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
})
"""torch.nn's modules whose output is finite whenever their input and their parameters are: an embedding
picks rows of its weight; a normalisation subtracts the mean and divides by sqrt(var + eps) (fp16/bf16 in
fp32), then scales and shifts. Their parameters are checked every step (the probe) and their input is
the output of the module before (or the model's input, checked too), so where they are not sharded by a
framework they need no hook either: on a transformer, a third of the activations summed every step."""


def finite_preserving(mod: torch.nn.Module) -> bool:
    """Finite output from finite input and parameters (exact torch.nn classes: a subclass may compute anything)."""
    cls = type(mod)
    return cls.__module__.startswith("torch.nn.modules.") and (
        cls.__name__ in FINITE_PRESERVING_NAMES or cls.__name__ in FINITE_GIVEN_PARAMETERS_NAMES)


MAX_KEYS = 4096
"""Distinct keys a per-step record keeps (modules, gradient buckets); more fold into one."""


def finite_norm(t: torch.Tensor) -> float:
    """The norm whose finiteness says whether every value is finite, the cheapest where ``t`` lives. The
    inf-norm (max |x|) cannot overflow, and is what a GPU's fused kernel does fast; torch's CPU inf-norm
    runs at about 1.2 GB/s here, its 2-norm (squares summed in double on the CPU) about 30 times faster,
    and it overflows only past 1e35 (the sqrt back to float32): a finite-or-not answer all the same."""
    return INF if t.device.type != "cpu" else 2.0


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """max |x| of ``t`` as a device scalar: NaN when ``t`` holds a NaN, Inf when it holds an Inf, finite
    otherwise, and never overflowed by finite values (a float32 sum of values near 1e38 is Inf: a model
    input of 1e38 was named as the NaN's origin). No host read. On a GPU the inf-norm is one fused
    kernel; on a CPU torch's inf-norm runs at about 1.2 GB/s, ``aminmax`` (one pass) about 15 times faster."""
    if not t.numel():  # an expert that got no tokens, a head with no boxes: nothing non-finite
        return torch.zeros((), dtype=torch.float32, device=t.device)
    if t.device.type == "cpu":
        lo, hi = torch.aminmax(t)
        return torch.maximum(hi, lo.neg())  # maximum() keeps a NaN of either
    return torch.linalg.vector_norm(t, INF)


def max_abs_each(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``finite_flag`` of each tensor, as one vector on the first one's device (one fused kernel on a device
    where they all are)."""
    if len({t.device for t in tensors}) > 1:  # a model over several devices (model parallel by hand, offload)
        return torch.stack([finite_flag(t).to(tensors[0].device) for t in tensors])
    if tensors[0].device.type == "cpu":
        return torch.stack([finite_flag(t) for t in tensors])
    return torch.stack(torch._foreach_norm(tensors, INF))


def fold_in(acc: dict[Any, torch.Tensor], key: Any, total: torch.Tensor) -> None:
    """acc[key] = max(|acc[key]|, |total|) on the device (``total``: a ``finite_flag`` or a norm): a NaN or
    Inf survives, a finite value cannot overflow, and the record stays one small tensor per key however
    often the key comes (an evaluation loop's all_reduce of metrics, gradient accumulation). The key's
    first value is kept as it is, with no kernel of its own: only finiteness is ever asked of it (the
    common case, one call per key per step, costs the caller's one flag and nothing more)."""
    seen = acc.get(key)
    if seen is None:
        if len(acc) >= MAX_KEYS:
            key = ("…",)
            seen = acc.get(key)
        if seen is None:
            acc[key] = total
            return
    torch.maximum(seen.abs_(), total.abs(), out=seen)


def all_finite(values: Any) -> bool:
    """Whether every number in ``values`` is finite: the host's side of the step's flags, as the readout gives them
    (numbers, and lists of numbers or of lists). A flag is a max |x| or a norm: a NaN or Inf anywhere in what it
    covers makes it non-finite."""
    isfinite = math.isfinite
    for v in values:
        if type(v) is list:
            if not all_finite(v):
                return False
        elif not isfinite(v):
            return False
    return True
