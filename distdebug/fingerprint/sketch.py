"""Numeric sketches of tensors: the distance between two runs' tensors from a few hundred numbers each.

A fingerprint (``fingerprint.hashing``) says whether two tensors are equal bit for bit; two layouts of one
training (1 rank against N, DDP against FSDP2) never are, so comparing them (issue 50, ``distdebug parity``)
needs how far apart they are: ``||a - b||`` for tensors too large to keep at every recorded step.

The sketch is linear, so the sketches' difference is the sketch of the difference, and its error is relative
to ``||a - b||`` itself, not to ``||a||`` (a benign difference of 1e-7 of a tensor's norm stays measurable):

1. every element, by its **global** flat index ``i``, gets a bucket ``h(i)`` of ``m`` and a sign ``s(i)`` from a
   64-bit mix of ``(seed, i)`` (splitmix64's finaliser on int64 with wrap-around: the same bits on every
   device), and ``z[h(i)] += s(i) * x[i]`` in float64 (an fp32 accumulation would round at about
   ``u * ||x||``, the size of what is measured);
2. ``y = G z / sqrt(k)``, ``G`` a ``k x m`` standard Gaussian matrix drawn on the CPU from ``seed`` (the same
   matrix on every device and process).

``||y_a - y_b||^2`` estimates ``||a - b||^2`` without bias; its relative standard deviation is about
``sqrt(2/k + 2/m)`` (``relative_error``): about 0.13 on the square, 0.065 on the norm, at the defaults.

Shards: a rank that holds the elements at global offset ``offset`` sketches them with their global indices
(``offset + local index``), and the full tensor's sketch is the sum of its shards' (``z`` is a sum over
elements, ``G`` is linear): a sharded candidate is compared with a whole reference without gathering.
A contiguous shard (FSDP2's ``Shard(0)``, a ZeRO partition) is an offset; a strided one (tensor parallel's
columns) is a block at an offset in each dimension (``sketch_block``: its global indices made a chunk at a time).

GPU-shaped: no host read; the result is a device tensor of ``k`` float64 numbers, read with the step's others.
The elements are visited in chunks of ``CHUNK`` so that the indices and signs never take more memory than that.
Summed with ``index_add_`` (atomics on CUDA: the order of the float64 sums may differ between two runs, by about
1e-16 of the norm; far below what a comparison needs).
"""

from __future__ import annotations

import functools
import math

import torch

K = 128
"""Rows of the sketch: its relative error on a squared distance is about sqrt(2/K + 2/M)."""
M = 4096
"""Buckets the elements are folded into before the projection (a power of two)."""
CHUNK = 1 << 22
"""Elements sketched at a time: bounds the indices' and signs' memory (32 MB of int64)."""


def _signed(x: int) -> int:
    """A 64-bit constant as the signed int64 torch multiplies with (wrapping, as the unsigned product would)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_C1 = _signed(0xBF58476D1CE4E5B9)
_C2 = _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """A logical right shift of int64 (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def mix(index: torch.Tensor, seed: int) -> torch.Tensor:
    """splitmix64's finaliser of ``index * golden + seed``, on int64 with wrap-around: 64 well-mixed bits per
    index, the same on every device."""
    z = index * _GOLDEN + _signed((seed * 0x2545F4914F6CDD1D) % (1 << 64))
    z = (z ^ _shr(z, 30)) * _C1
    z = (z ^ _shr(z, 27)) * _C2
    return z ^ _shr(z, 31)


@functools.lru_cache(maxsize=4)
def _projection(seed: int, k: int, m: int, device: str) -> torch.Tensor:
    """The k x m Gaussian matrix of ``seed``, drawn on the CPU (the same on every device), in float64, kept on
    ``device`` (copied there once, not at every tensor)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(k, m, generator=g, dtype=torch.float64) / math.sqrt(k)).to(device)


def fold(values: torch.Tensor, index: torch.Tensor, seed: int, m: int = M) -> torch.Tensor:
    """``z`` of step 1 for these elements (flat ``values`` at flat global ``index``): m float64 sums."""
    z = torch.zeros(m, dtype=torch.float64, device=values.device)
    for start in range(0, values.numel(), CHUNK):
        h = mix(index[start:start + CHUNK], seed)
        bucket = h & (m - 1)
        sign = (_shr(h, 40) & 1).to(torch.float64) * 2 - 1
        z.index_add_(0, bucket, values[start:start + CHUNK].to(torch.float64) * sign)
    return z


def project(z: torch.Tensor, seed: int, k: int = K) -> torch.Tensor:
    """``y`` of step 2: the k-number sketch of a fold (or of a sum of shards' folds)."""
    return _projection(seed, k, z.numel(), str(z.device)) @ z


def sketch(t: torch.Tensor, seed: int = 0, offset: int = 0, k: int = K, m: int = M) -> torch.Tensor:
    """The sketch of ``t``'s elements, in row-major order, placed at global flat index ``offset`` onwards."""
    flat = t.detach().reshape(-1)
    z = torch.zeros(m, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start:start + CHUNK]
        index = torch.arange(offset + start, offset + start + part.numel(), device=flat.device, dtype=torch.int64)
        z += fold(part, index, seed, m)
    return project(z, seed, k)


def sketch_block(t: torch.Tensor, offset: tuple[int, ...], full: tuple[int, ...], seed: int = 0, k: int = K,
                 m: int = M) -> torch.Tensor:
    """The sketch of ``t``, the block of a tensor of shape ``full`` that starts at ``offset`` (one number per
    dimension: a column shard is a block at a column offset), each element at its global flat index. The indices
    are made a CHUNK at a time: never an index as large as the block (8 bytes an element)."""
    flat = t.detach().reshape(-1)
    shape, n = tuple(t.shape), t.dim()
    strides = [math.prod(full[d + 1:]) for d in range(n)]
    z = torch.zeros(m, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start:start + CHUNK]
        rest = torch.arange(start, start + part.numel(), device=flat.device, dtype=torch.int64)
        index = torch.zeros_like(rest)
        for d in reversed(range(n)):  # the local flat index unravelled, each coordinate moved to its global place
            index += (rest % shape[d] + offset[d]) * strides[d]
            rest = rest // shape[d]
        z += fold(part, index, seed, m)
    return project(z, seed, k)


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The estimate of ``||x_a - x_b||`` from two sketches of the same seed (float64; a host read)."""
    return float(torch.linalg.vector_norm((a - b).to(torch.float64)))


def relative_error(k: int = K, m: int = M) -> float:
    """About one standard deviation of ``distance``, relative to the true distance: half the squared
    estimate's ``sqrt(2/k + 2/m)`` (an upper estimate: the fold's part is smaller for a spread difference)."""
    return 0.5 * math.sqrt(2 / k + 2 / m)
