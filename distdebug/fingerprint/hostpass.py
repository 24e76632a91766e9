"""One pass over many CPU tensors at once, on the host: the CPU's multi-tensor kernel (issue 62).

Why: on a GPU, torch's multi-tensor ops (``_foreach_norm``) check a thousand tensors in a few fused launches, and
the host pays a few microseconds. On a CPU the same op falls back to one dispatched kernel per tensor, about 3 us
each: on a 1,000-tensor model, 3 ms a pass, and the harness made three such passes a step (the parameters'
finiteness, each local gradient's norm, the parameters' fingerprints). Here a CPU tensor is read in place
through a zero-copy view of its bytes (its address and length, never ``Tensor.numpy()``, which would pin its
storage: FSDP2 frees storages by resizing them), and the tensors of a pass are joined, a bounded chunk at a time,
into one numpy buffer: one vectorised test or sum over them all, a few microseconds of Python per chunk and
about half a microsecond a tensor.

A list that comes back every step keeps its plan (``HostPass``: which chunk and offset each tensor's bytes go
to, one buffer of at most CHUNK elements a dtype, reused for every chunk), made again only when its dtypes or
lengths change; tensors that stayed where they were are read in place, tensors that moved (gradients come back
at new addresses every step) are gathered by address. Nothing holds a tensor: the caller holds them while a pass
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
NBYTES: Any = vars(torch._C.TensorBase)["nbytes"].__get__
DTYPE: Any = vars(torch._C.TensorBase)["dtype"].__get__
SHAPE: Any = vars(torch._C.TensorBase)["shape"].__get__
_PLAIN = {torch.Tensor, torch.nn.Parameter}
_NONE = type(None)
_MEMMOVE = ctypes.memmove


def plain_cpu(tensors: list[Any]) -> bool:
    """Whether these are all plain contiguous CPU tensors (not a subclass, a DTensor or a strided view): those
    whose bytes the host reads in place by address and length."""
    return (set(map(type, tensors)) <= _PLAIN and all(map(IS_CPU, tensors))
            and all(map(torch.Tensor.is_contiguous, tensors)))


def any_none(items: list[Any]) -> bool:
    """Whether any of these is None (a parameter's missing gradient), by type over the list in C: ``None in``
    would call each tensor's ``__eq__``, and a generator costs a Python step an item."""
    return _NONE in set(map(type, items))


def byte_view(ptr: int, n: int) -> Any:
    """The ``n`` bytes at ``ptr`` as a buffer, no copy (``b""`` for none): made fresh, a few tenths of a
    microsecond (ctypes caches the array types). It does not keep the memory alive: the caller holds the tensor."""
    return (ctypes.c_char * n).from_address(ptr) if n else b""


def _array(ptr: int, n: int, dtype: Any) -> np.ndarray:
    """A numpy array over ``n`` bytes at ``ptr`` (no copy), of ``dtype``."""
    if not n:
        return np.empty(0, dtype)
    return np.frombuffer(byte_view(ptr, n), dtype=dtype)  # a buffer numpy reads in place


class _Chunk:
    """Small tensors of one dtype read together: where each one's bytes go in its group's buffer."""

    __slots__ = ("dst", "members", "size", "sizes", "span", "starts")

    def __init__(self, members: list[int], nbytes: list[int], item: int, base: int) -> None:
        self.members = members
        # members that follow one another in the list (the common case: one dtype): their addresses are a slice
        self.span = slice(members[0], members[-1] + 1) if members == list(range(members[0], members[-1] + 1)) \
            else None
        self.sizes = [nbytes[j] for j in members]
        starts = np.cumsum([0] + [n // item for n in self.sizes[:-1]])
        self.starts = starts  # each tensor's first element in the buffer
        self.dst = [base + st * item for st in starts.tolist()]
        self.size = sum(self.sizes) // item  # elements


class _Plan:
    """Where each tensor of a list of this shape (dtypes and lengths) is read: small ones a chunk of at most CHUNK
    elements at a time, gathered into one buffer a dtype (filled again for each chunk: the memory a pass holds is
    that buffer, whatever the model's size), a large one in place, a block at a time."""

    def __init__(self, dtypes: list[Any], nbytes: list[int], table: dict[Any, Any]) -> None:
        self.dtypes, self.nbytes = dtypes, nbytes
        by_dtype: dict[Any, list[int]] = {}
        for i, d in enumerate(dtypes):
            if nbytes[i]:  # empty tensors hold nothing to read
                by_dtype.setdefault(d, []).append(i)
        # (dtype, its buffer, its chunks, the tensors read alone)
        self.groups: list[tuple[Any, np.ndarray, list[_Chunk], list[int]]] = []
        for dtype, idx in by_dtype.items():
            kind = table[dtype][0] if isinstance(table[dtype], tuple) else table[dtype]
            item = np.dtype(kind).itemsize
            alone = [i for i in idx if nbytes[i] // item > CHUNK]
            small = [i for i in idx if nbytes[i] // item <= CHUNK]
            members: list[list[int]] = []
            total = 0
            for i in small:
                n = nbytes[i] // item
                if not members or total + n > CHUNK:
                    members.append([])
                    total = 0
                members[-1].append(i)
                total += n
            buf = np.empty(max((sum(nbytes[j] for j in m) // item for m in members), default=0), dtype=kind)
            self.groups.append((dtype, buf, [_Chunk(m, nbytes, item, buf.ctypes.data) for m in members], alone))


class HostPass:
    """A pass over a list of CPU tensors that comes back every step (the parameters, the local gradients). Its
    plan is made once for the list's dtypes and lengths. Tensors at the addresses of the last call (parameters)
    are read in place through arrays made once, joined into the plan's buffer a chunk at a time; tensors that
    moved (gradients come back at new addresses every step) are checked to be plain contiguous CPU tensors and
    gathered by address, one ``memmove`` a small tensor. Then one numpy test or sum a chunk. One per list and
    purpose."""

    def __init__(self) -> None:
        self._plan: _Plan | None = None
        self._table: dict[Any, Any] | None = None
        self._ptrs: list[int] | None = None  # the addresses of the last call, when its tensors were checked
        self._arrays: dict[int, list[np.ndarray]] = {}  # id of a chunk -> arrays in place, for those addresses

    def _plan_for(self, tensors: list[Any], table: dict[Any, Any]) -> tuple[_Plan, list[int], bool] | None:
        """The plan, every tensor's address, and whether they are where they were at the last call (read in
        place); None when a tensor is not for the host path."""
        if not tensors or not getattr(tensors[0], "is_cpu", False):  # a device's tensors: its fused kernels, at once
            return None
        plan = self._plan
        try:
            ptrs = list(map(DATA_PTR, tensors))
            nbytes = list(map(NBYTES, tensors))
        except (TypeError, RuntimeError):  # not a tensor, or one without storage
            return None
        if plan is not None and self._table is table and ptrs == self._ptrs and nbytes == plan.nbytes:
            # The very memory a plain CPU tensor of this length held at the last call
            return plan, ptrs, True
        self._ptrs, self._arrays = None, {}
        if not plain_cpu(tensors):
            return None
        dtypes = list(map(DTYPE, tensors))
        if plan is None or self._table is not table or plan.dtypes != dtypes or plan.nbytes != nbytes:
            if not all(d in table for d in dtypes):
                return None
            plan = self._plan = _Plan(dtypes, nbytes, table)
            self._table = table
        self._ptrs = ptrs
        return plan, ptrs, False

    def _fill(self, buf: np.ndarray, chunk: _Chunk, ptrs: list[int], in_place: bool) -> np.ndarray:
        """The chunk's tensors' values, joined in ``buf`` (its first ``chunk.size`` elements)."""
        out = buf[:chunk.size]
        if in_place:
            arrays = self._arrays.get(id(chunk))
            if arrays is None:
                arrays = self._arrays[id(chunk)] = [_array(ptrs[j], n, buf.dtype)
                                                    for j, n in zip(chunk.members, chunk.sizes, strict=True)]
            np.concatenate(arrays, out=out)
        else:
            src = ptrs[chunk.span] if chunk.span is not None else [ptrs[j] for j in chunk.members]
            list(map(_MEMMOVE, chunk.dst, src, chunk.sizes))
        return out

    def any_nonfinite(self, tensors: list[Any]) -> bool | None:
        """Whether any value of these CPU tensors is NaN or Inf, read from their exponent bits (exact: no sum
        that overflows); None when a tensor is not for the host path (the caller takes torch's)."""
        got = self._plan_for(tensors, _EXP)
        if got is None:
            return None
        plan, ptrs, in_place = got
        for dtype, buf, chunks, alone in plan.groups:
            word, mask = _EXP[dtype]
            for chunk in chunks:
                if np.any((self._fill(buf, chunk, ptrs, in_place) & mask) == mask):
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
        got = self._plan_for(tensors, _NUMPY_FLOAT)
        if got is None:
            return None
        plan, ptrs, in_place = got
        out = np.zeros(len(tensors), dtype=np.float64)
        for dtype, buf, chunks, alone in plan.groups:
            for chunk in chunks:
                x = self._fill(buf, chunk, ptrs, in_place).astype(np.float32, copy=False)
                out[chunk.members] = np.add.reduceat(x * x, chunk.starts, dtype=np.float64)
            for i in alone:
                a = _array(ptrs[i], plan.nbytes[i], _NUMPY_FLOAT[dtype])
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


class HostCopy:
    """Copies a list of CPU tensors into a list of the same dtypes and lengths on the host (torch's
    ``_foreach_copy_`` runs one dispatched kernel a tensor on a CPU, about 1 us each; the capture copies every
    parameter every step). Destinations that lie end to end in memory (``flat_clones``) are filled by one
    ``np.concatenate`` over arrays made once on the sources' bytes (0.1 us a tensor); others by a ``memmove`` each
    (0.8 us). The addresses are checked each call (0.1 us a tensor, mapped in C), so a source that moved or changed
    length is never read from its old place; a new list is first checked to be plain contiguous CPU tensors.
    ``copy`` answers False when they are not (the caller takes torch's path)."""

    def __init__(self) -> None:
        self._key: tuple[list[int], list[int]] | None = None
        self._runs: list[tuple[np.ndarray, list[np.ndarray]]] = []
        self._single: tuple[list[int], list[int], list[int]] = ([], [], [])
        self._dst: Any = None  # the destination list of the last call, when the caller owns it

    def copy(self, dst: list[Any], src: list[Any], owned: bool = False) -> bool:
        """``owned``: ``dst`` is the caller's own list of its own tensors, never changed (the capture's copies):
        the same list object as at the last call is at the same addresses, which are not read again."""
        if not src or len(dst) != len(src) or not getattr(src[0], "is_cpu", False):
            return False
        try:
            sptrs = list(map(DATA_PTR, src))
            dptrs = self._key[0] if owned and dst is self._dst and self._key is not None else list(map(DATA_PTR, dst))
        except (TypeError, RuntimeError):  # not a tensor, or one without storage
            return False
        self._dst = dst if owned else None
        if self._key is None or self._key[0] != dptrs or self._key[1] != sptrs:
            self._key = None
            if not self._plan(dst, src, dptrs, sptrs):
                return False
            self._key = (dptrs, sptrs)
        for out, arrays in self._runs:
            np.concatenate(arrays, out=out)
        list(map(_MEMMOVE, *self._single))
        return True

    def _plan(self, dst: list[Any], src: list[Any], dptrs: list[int], sptrs: list[int]) -> bool:
        both = [*dst, *src]
        if not (plain_cpu(both) and list(map(DTYPE, dst)) == list(map(DTYPE, src))):
            return False
        sizes = list(map(NBYTES, src))
        if sizes != list(map(NBYTES, dst)):
            return False
        order = sorted((i for i in range(len(src)) if sizes[i]), key=lambda i: dptrs[i])
        runs: list[list[int]] = []
        for i in order:  # destinations end to end in memory: one run
            if runs and dptrs[runs[-1][-1]] + sizes[runs[-1][-1]] == dptrs[i]:
                runs[-1].append(i)
            else:
                runs.append([i])
        self._runs = [(_array(dptrs[r[0]], sum(sizes[i] for i in r), np.uint8),
                       [_array(sptrs[i], sizes[i], np.uint8) for i in r]) for r in runs if len(r) > 1]
        alone = [r[0] for r in runs if len(r) == 1]
        self._single = ([dptrs[i] for i in alone], [sptrs[i] for i in alone], [sizes[i] for i in alone])
        return True


def flat_clones(tensors: list[Any]) -> list[Any]:
    """Clones of these tensors laid end to end in one buffer a dtype (``HostCopy`` fills them in one call); plain
    clones when they are not all plain contiguous CPU tensors."""
    if not tensors or not plain_cpu(tensors):
        return [t.detach().clone() for t in tensors]
    out: list[Any] = [None] * len(tensors)
    by_dtype: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx]) if idx else torch.empty(0, dtype=dtype)
        for i, part in zip(idx, flat.split([tensors[i].numel() for i in idx]), strict=True):
            out[i] = part.view(tensors[i].shape)
    return out
