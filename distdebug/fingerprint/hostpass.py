"""One pass over many CPU tensors at once, on the host: the CPU's multi-tensor kernel (issue 62).

Why: on a GPU, torch's multi-tensor ops (``_foreach_norm``) check a thousand tensors in a few fused launches, and
the host pays a few microseconds. On a CPU the same op falls back to one dispatched kernel per tensor, about 3 us
each: on a 1,000-tensor model, 3 ms a pass, and the harness made three such passes a step (the parameters'
finiteness, each local gradient's norm, the parameters' fingerprints). Here a CPU tensor is read in place
through a zero-copy view of its bytes (its address and length, never ``Tensor.numpy()``, which would pin its
storage: FSDP2 frees storages by resizing them), and the tensors of a pass are joined, a bounded chunk at a time,
into one numpy buffer: one vectorised test or sum over them all, a few microseconds of Python per chunk and
about half a microsecond a tensor.

A list that comes back every step keeps its plan (``HostPass``: which buffer and offset each tensor's bytes go
to), made again only when its dtypes or lengths change; the bytes are gathered by address at each call, since
gradients come back at new addresses every step. Nothing holds a tensor: the caller holds them while a pass
reads them.

Only for what numpy can read exactly: float64, float32, float16 and bfloat16 (as 16-bit words) for finiteness;
float64, float32 and float16 for norms. Anything else (another device, a DTensor, a strided view, bfloat16
norms) answers None and the caller takes torch's path.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

CHUNK = 1 << 18
"""Elements joined into one buffer at most (1 MiB of float32): temporaries stay small whatever the model."""

_EXP = {  # dtype -> (numpy word type, exponent mask): a value is not finite iff its exponent bits are all set
    torch.float32: (np.uint32, 0x7F800000),
    torch.float64: (np.uint64, 0x7FF0000000000000),
    torch.float16: (np.uint16, 0x7C00),
    torch.bfloat16: (np.uint16, 0x7F80),
}
_NUMPY_FLOAT = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}

# A tensor's address and attributes, mapped over a list in C (a Python loop costs twice as much); shared with the
# fingerprints' and the capture's checks of the same lists
DATA_PTR = torch.Tensor.data_ptr
IS_CPU: Any = vars(torch._C.TensorBase)["is_cpu"].__get__
_NBYTES: Any = vars(torch._C.TensorBase)["nbytes"].__get__
_DTYPE: Any = vars(torch._C.TensorBase)["dtype"].__get__
_PLAIN = {torch.Tensor, torch.nn.Parameter}
_MEMMOVE = ctypes.memmove


def _array(ptr: int, n: int, dtype: Any) -> np.ndarray:
    """A numpy array over ``n`` bytes at ``ptr`` (no copy), of ``dtype``."""
    if not n:
        return np.empty(0, dtype)
    view: Any = (ctypes.c_char * n).from_address(ptr)  # a buffer numpy reads in place
    return np.frombuffer(view, dtype=dtype)


class _Plan:
    """Where each tensor of a list of this shape (dtypes and lengths) goes: small ones are gathered by address into
    buffers of at most CHUNK elements a dtype (one ``memmove`` each), a large one is read in place."""

    def __init__(self, dtypes: list[Any], nbytes: list[int], table: dict[Any, Any]) -> None:
        self.dtypes, self.nbytes = dtypes, nbytes
        by_dtype: dict[Any, list[int]] = {}
        for i, d in enumerate(dtypes):
            if nbytes[i]:  # empty tensors hold nothing to read
                by_dtype.setdefault(d, []).append(i)
        self.moves: tuple[list[int], list[int], list[int]] = ([], [], [])  # (tensor index, destination, bytes)
        # (dtype, [(tensor indices, buffer, element starts)] gathered, [(tensor index, element type)] in place)
        self.groups: list[tuple[Any, list[tuple[list[int], np.ndarray, np.ndarray]], list[int]]] = []
        for dtype, idx in by_dtype.items():
            kind = table[dtype][0] if isinstance(table[dtype], tuple) else table[dtype]
            item = np.dtype(kind).itemsize
            gathered: list[tuple[list[int], np.ndarray, np.ndarray]] = []
            alone: list[int] = []
            chunk: list[int] = []
            total = 0
            for i in idx + [-1]:
                n = nbytes[i] // item if i >= 0 else 0
                if i >= 0 and n > CHUNK:
                    alone.append(i)
                    continue
                if chunk and (i < 0 or total + n > CHUNK):
                    sizes = [nbytes[j] // item for j in chunk]
                    buf = np.empty(sum(sizes), dtype=kind)
                    base = buf.ctypes.data
                    starts = np.cumsum([0] + sizes[:-1])
                    for j, st in zip(chunk, starts.tolist(), strict=True):
                        self.moves[0].append(j)
                        self.moves[1].append(base + st * item)
                        self.moves[2].append(nbytes[j])
                    gathered.append((chunk, buf, starts))
                    chunk, total = [], 0
                if i >= 0:
                    chunk.append(i)
                    total += n
            self.groups.append((dtype, gathered, alone))


class HostPass:
    """A pass over a list of CPU tensors that comes back every step (the parameters, the local gradients). Its
    plan is made once for the list's dtypes and lengths. Tensors at the addresses of the last call (parameters)
    are read in place through arrays made once, joined into the plan's buffers; tensors that moved (gradients
    come back at new addresses every step) are checked to be plain contiguous CPU tensors and gathered by address,
    one ``memmove`` a small tensor. Then one numpy test or sum a chunk. One per list and purpose."""

    def __init__(self) -> None:
        self._plan: _Plan | None = None
        self._table: dict[Any, Any] | None = None
        self._ptrs: list[int] | None = None  # the addresses of the last call
        self._arrays: list[tuple[list[np.ndarray], np.ndarray]] | None = None  # in place, for those addresses

    def _gather(self, tensors: list[Any], table: dict[Any, Any]) -> tuple[_Plan, list[int]] | None:
        """The plan, with the small tensors' bytes gathered into its buffers, and every tensor's address; None
        when a tensor is not for the host path."""
        if not tensors or not getattr(tensors[0], "is_cpu", False):  # a device's tensors: its fused kernels, at once
            return None
        plan = self._plan
        try:
            ptrs = list(map(DATA_PTR, tensors))
            nbytes = list(map(_NBYTES, tensors))
        except (TypeError, RuntimeError):  # not a tensor, or one without storage
            return None
        if plan is not None and self._table is table and ptrs == self._ptrs and nbytes == plan.nbytes:
            # The very memory a plain CPU tensor of this length held at the last call: read in place again
            if self._arrays is None:
                self._arrays = [([_array(ptrs[i], plan.nbytes[i], buf.dtype) for i in members], buf)
                                for _, gathered, _ in plan.groups for members, buf, _ in gathered]
            for arrays, buf in self._arrays:
                np.concatenate(arrays, out=buf)
            return plan, ptrs
        self._ptrs, self._arrays = None, None
        if not (set(map(type, tensors)) <= _PLAIN and all(map(IS_CPU, tensors))
                and all(map(torch.Tensor.is_contiguous, tensors))):
            return None
        dtypes = list(map(_DTYPE, tensors))
        if plan is None or self._table is not table or plan.dtypes != dtypes or plan.nbytes != nbytes:
            if not all(d in table for d in dtypes):
                return None
            plan = self._plan = _Plan(dtypes, nbytes, table)
            self._table = table
        index, dst, size = plan.moves
        list(map(_MEMMOVE, dst, [ptrs[i] for i in index], size))
        self._ptrs = ptrs
        return plan, ptrs

    def any_nonfinite(self, tensors: list[Any]) -> bool | None:
        """Whether any value of these CPU tensors is NaN or Inf, read from their exponent bits (exact: no sum
        that overflows); None when a tensor is not for the host path (the caller takes torch's)."""
        got = self._gather(tensors, _EXP)
        if got is None:
            return None
        plan, ptrs = got
        for dtype, gathered, alone in plan.groups:
            word, mask = _EXP[dtype]
            for _, buf, _ in gathered:
                if np.any((buf & mask) == mask):
                    return True
            for i in alone:
                a = _array(ptrs[i], plan.nbytes[i], word)
                for o in range(0, a.size, CHUNK):  # a large tensor a block at a time: bounded temporaries
                    if np.any((a[o:o + CHUNK] & mask) == mask):
                        return True
        return False

    def norms(self, tensors: list[Any]) -> np.ndarray | None:
        """The 2-norm of each CPU tensor (float32 squares summed in float64), as a float32 array in the tensors'
        order; None when a tensor is not for the host path. A NaN or Inf gives a non-finite norm."""
        got = self._gather(tensors, _NUMPY_FLOAT)
        if got is None:
            return None
        plan, ptrs = got
        out = np.zeros(len(tensors), dtype=np.float64)
        for dtype, gathered, alone in plan.groups:
            kind = _NUMPY_FLOAT[dtype]
            for members, buf, starts in gathered:
                x = buf.astype(np.float32, copy=False)
                out[members] = np.add.reduceat(x * x, starts, dtype=np.float64)
            for i in alone:
                a = _array(ptrs[i], plan.nbytes[i], kind)
                total = 0.0
                for o in range(0, a.size, CHUNK):
                    x = a[o:o + CHUNK].astype(np.float64)
                    total += float(np.dot(x, x))
                out[i] = total
        with np.errstate(invalid="ignore", over="ignore"):
            return np.sqrt(out).astype(np.float32)


def any_nonfinite(tensors: list[Any]) -> bool | None:
    """``HostPass.any_nonfinite`` for a list seen once."""
    return HostPass().any_nonfinite(tensors)


def norms(tensors: list[Any]) -> np.ndarray | None:
    """``HostPass.norms`` for a list seen once."""
    return HostPass().norms(tensors)
