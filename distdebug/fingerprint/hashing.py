"""Fingerprints of tensors that change when any bit changes, the same wherever the tensor lives.

One definition, two implementations. A tensor's bytes are read as little-endian signed 32-bit words
``w_0 .. w_{n-1}`` (zero-padded to a multiple of 4 bytes); its fingerprint is xxh3-64 over two sums
taken modulo 2^64,

    plain = sum(w_i)        weighted = sum((i + 1) * w_i)

seeded with its dtype and shape, so that equal bytes under another dtype or shape never compare
equal. Any single-bit change moves one word by +-2^k (k < 32) and so always changes ``plain``; two
words that trade places (i < j) change ``weighted`` by (w_i - w_j)(j - i), which is never 0 modulo
2^64 (fewer than 33 + 31 factors of two). The sums do not depend on how they are split up, so:

- The device path (``device_sums``) computes them where the tensor lives, with a constant number of
  kernels per group of small tensors (fused into one buffer, per-tensor sums by prefix sums) and one
  pass in fixed blocks over a large one; temporaries stay under a few blocks (``BLOCK`` words)
  whatever the tensor's size. Only 16 bytes per tensor cross to the host, when the caller reads
  them: ``PendingFingerprints`` hands the device rows to the step's one host read (runtime.readout).
- The CPU path (``cpu_sums``) computes the same sums with numpy over the tensor's bytes in place
  (no copy, no torch kernel, no host synchronisation).

A tensor fingerprinted on a GPU and its copy on the CPU (a checkpoint loaded with map_location, a
CPU-offloaded shard) have the same *portable* fingerprint. ``DISTDEBUG_DEVICE_PATH=1`` sends CPU tensors
down the device path too: the tests prove on CPU what a GPU run does, read for read.

The fast CPU fingerprint (``fast_cpu_fingerprint``, issue 18): numpy's sums run at about 1.5 GB/s
here (32-bit words widened to int64, a weighted pass), a twentieth of a plain read pass, while xxh3
over the same bytes runs at the read pass's speed (26 GB/s against torch.sum's 25, one thread). Where
fingerprints are compared with fingerprints of the same tensor on other ranks of the same job (replicas,
initial parameters, batches), every rank holds it on the same kind of device, so a CPU tensor takes
xxh3-64 of its bytes, seeded with its dtype and shape and a tag of its own (never equal to a portable
fingerprint by construction): any change of any byte changes it. Where a fingerprint may meet a copy on
another device (a checkpoint saved from GPU tensors and loaded with map_location="cpu"), the portable
one is taken (``fingerprints(..., portable=True)``).

DTensor (FSDP2) shards are fingerprinted as the local shard; non-contiguous tensors are made
contiguous first (a copy, only for them).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch
import xxhash

from distdebug.fingerprint.hostpass import byte_view

_MASK64 = (1 << 64) - 1
BLOCK = 1 << 20
"""Words per pass over a large tensor: its temporaries are two int64 blocks (16 MiB), whatever its size."""
GROUP = 1 << 18
"""Tensors up to this many words are fused with others into one pass of at most this many words."""


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds: a DTensor's local shard, detached, contiguous."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:  # DTensor (also as a Parameter)
        to_local = getattr(t, "to_local", None)
        if callable(to_local):
            t = to_local()
    t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


_SEEDS: dict[tuple[Any, ...], int] = {}


def _seed(t: torch.Tensor) -> int:
    """xxh3 seed from dtype and shape (cached: the header is the same every step)."""
    return seed_for(t.dtype, t.shape)


def seed_for(dtype: Any, shape: Any) -> int:
    """The seed of a tensor of this dtype and shape (``torch.Size``), as ``_seed``."""
    key = (dtype, shape)
    seed = _SEEDS.get(key)
    if seed is None:
        seed = _SEEDS[key] = xxhash.xxh3_64_intdigest(f"{dtype}|{tuple(shape)}".encode())
    return seed


def shape_seed(t: torch.Tensor) -> int:
    """What a fingerprint folds in besides the bytes (dtype and shape): host metadata, no device read."""
    return _seed(t)


def combine_device(fp: Any, t: torch.Tensor | int) -> int:
    """The fingerprint from the two sums (on the host) and dtype and shape (the tensor, or its
    ``shape_seed``, which needs no reference to the tensor): one 64-bit int."""
    a, b = (int(x) & _MASK64 for x in fp)
    return xxhash.xxh3_64_intdigest(a.to_bytes(8, "little") + b.to_bytes(8, "little"),
                                    t if isinstance(t, int) else _seed(t))


# ---------------------------------------------------------------- the CPU path (numpy, in place)
def _bytes(t: torch.Tensor) -> Any:
    """A zero-copy byte view of a contiguous CPU tensor, taken from its data pointer.

    Not ``Tensor.numpy()``: exporting to numpy marks the storage as non-resizable for good, and FSDP2
    frees its gathered parameters with ``storage.resize_(0)``: hashing them that way breaks training.
    The view does not keep the tensor alive: callers hold the tensor until the hash is done. Made fresh
    (``hostpass.byte_view``): a cache of views by address cost as much to look up,
    and its entries, kept for a few steps and dropped, were objects the interpreter's collector promoted
    and then had to walk in a full collection (issue 62).
    """
    return byte_view(t.data_ptr(), t.nbytes)


_NP_INDEX: dict[int, np.ndarray] = {}


def _np_index(n: int) -> np.ndarray:
    """0 .. n-1 as int64 (the largest one asked for, cached; callers slice it)."""
    have = next(iter(_NP_INDEX.values()), None)
    if have is None or len(have) < n:
        _NP_INDEX.clear()
        have = _NP_INDEX[0] = np.arange(max(n, 1024), dtype=np.int64)
    return have[:n]


def _np_words(raw: np.ndarray) -> np.ndarray:
    pad = (-len(raw)) % 4
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, dtype=np.uint8)])
    return raw.view("<i4").astype(np.int64)


def _cpu_large(t: torch.Tensor) -> tuple[int, int]:
    raw = np.frombuffer(_bytes(t), dtype=np.uint8)
    plain = weighted = 0
    step = 4 * BLOCK
    for o in range(0, len(raw), step):
        w = _np_words(raw[o:o + step])
        s = int(w.sum())
        plain += s
        weighted += (o // 4 + 1) * s + int((w * _np_index(len(w))).sum())
    return plain & _MASK64, weighted & _MASK64


def _cpu_group(ts: list[torch.Tensor]) -> list[tuple[int, int]]:
    """One numpy pass over several small tensors: their padded bytes joined, per-tensor sums by reduceat."""
    parts, starts, pos = [], [], 0
    for t in ts:
        n = t.nbytes
        pad = (-n) % 4
        parts.append(ctypes.string_at(t.data_ptr(), n) + b"\0" * pad)
        starts.append(pos)
        pos += (n + pad) // 4
    w = np.frombuffer(b"".join(parts), dtype="<i4").astype(np.int64)
    at = np.asarray(starts, dtype=np.int64)
    s = np.add.reduceat(w, at)
    g = np.add.reduceat(w * _np_index(len(w)), at)
    weighted = g - (at - 1) * s  # sum((i - start + 1) * w_i) over each tensor's words
    return [(int(a) & _MASK64, int(b) & _MASK64) for a, b in zip(s.tolist(), weighted.tolist(), strict=True)]


def _plan(words: list[int]) -> tuple[list[int], list[list[int]]]:
    """Which tensors (by their sizes in words) are read alone (over GROUP words: one blocked pass each)
    and which are fused, in groups of at most GROUP words (one pass per group): the same plan for
    both paths."""
    large: list[int] = []
    groups: list[list[int]] = []
    group: list[int] = []
    total = 0
    for i, n in enumerate(words):
        if n > GROUP:
            large.append(i)
            continue
        if group and total + n > GROUP:
            groups.append(group)
            group, total = [], 0
        group.append(i)
        total += n
    if group:
        groups.append(group)
    return large, groups


def cpu_sums_many(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(plain, weighted) of each CPU tensor, small ones fused: no torch kernel, nothing copied but small ones."""
    out: list[tuple[int, int]] = [(0, 0)] * len(tensors)  # an empty tensor's sums
    views = [local_view(t) for t in tensors]  # held until hashed: the byte views do not keep them alive
    nonempty = [i for i, v in enumerate(views) if v.nbytes]
    large, groups = _plan([(views[i].nbytes + 3) // 4 for i in nonempty])
    for j in large:
        out[nonempty[j]] = _cpu_large(views[nonempty[j]])
    for group in groups:
        members = [nonempty[j] for j in group]
        for i, v in zip(members, _cpu_group([views[i] for i in members]), strict=True):
            out[i] = v
    return out


def cpu_sums(t: torch.Tensor) -> tuple[int, int]:
    return cpu_sums_many([t])[0]


def cpu_fingerprint(t: torch.Tensor) -> int:
    """The portable fingerprint of a CPU tensor, any dtype (bf16 and bool too), computed on the host."""
    return combine_device(cpu_sums(t), local_view(t))


FAST_TAG = 0x9E3779B97F4A7C15
"""Folded into the fast fingerprint's seed: it lives in a value space of its own."""


def fast_cpu_fingerprint(t: torch.Tensor) -> int:
    """xxh3-64 of a CPU tensor's bytes in place (no copy, one pass at memory speed), seeded with its dtype,
    shape and FAST_TAG. For comparisons with the same tensor on other ranks, which hold it on the same
    kind of device; not equal to its portable fingerprint (``cpu_fingerprint``)."""
    v = _fast_view(t)
    return xxhash.xxh3_64_intdigest(_bytes(v), _seed(v) ^ FAST_TAG)


def _fast_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes the fast fingerprint reads: ``t`` itself when it is a plain contiguous tensor (no
    detach: called once per tensor per checked step, so the few microseconds of wrapping count)."""
    cls = type(t)
    return t if (cls is torch.Tensor or cls is torch.nn.Parameter) and t.is_contiguous() else local_view(t)


# ---------------------------------------------------------------- the device path (torch kernels)
_INDEX: dict[Any, torch.Tensor] = {}


def _index(n: int, device: torch.device) -> torch.Tensor:
    """0 .. n-1 as int64 on ``device`` (the largest asked for, cached per device; callers slice)."""
    have = _INDEX.get(device)
    if have is None or have.numel() < n:
        have = _INDEX[device] = torch.arange(max(n, 1024), dtype=torch.int64, device=device)
    return have[:n]


_PADS: dict[Any, torch.Tensor] = {}


def _pad(n: int, device: torch.device) -> torch.Tensor:
    """n (1 to 3) zero bytes on ``device``, made once: a fused group launches no kernel per padded tensor."""
    zeros = _PADS.get(device)
    if zeros is None:
        zeros = _PADS[device] = torch.zeros(4, dtype=torch.uint8, device=device)
    return zeros[:n]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return local_view(t).reshape(-1).view(torch.uint8)


def _words(b: torch.Tensor) -> torch.Tensor:
    """Bytes as int64 values of 32-bit words, zero-padded; a piece at an address that is not a multiple
    of 4 (a bf16/fp16 slice at an odd offset of a flat buffer: ZeRO's, DDP's bucket views) is copied."""
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    elif b.data_ptr() % 4:
        b = b.clone()
    return b.view(torch.int32).to(torch.int64)


def _device_large(b: torch.Tensor) -> torch.Tensor:
    s_parts, t_parts, first = [], [], []
    step = 4 * BLOCK
    for o in range(0, b.numel(), step):
        w = _words(b[o:o + step])
        s_parts.append(w.sum())
        t_parts.append((w * _index(w.numel(), b.device)).sum())
        first.append(o // 4 + 1)
    s = torch.stack(s_parts)
    at = torch.tensor(first, dtype=torch.int64).to(b.device, non_blocking=True)
    return torch.stack([s.sum(), (s * at).sum() + torch.stack(t_parts).sum()])


_LAYOUTS: dict[Any, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}


def _layout(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Word starts and ends of fused tensors of these byte sizes (cached: the same every step), and pads."""
    key = (sizes, device)
    got = _LAYOUTS.get(key)
    if got is None:
        if len(_LAYOUTS) > 256:
            _LAYOUTS.clear()
        starts, ends, pads, pos = [], [], [], 0
        for n in sizes:
            pad = (-n) % 4
            pads.append(pad)
            starts.append(pos)
            pos += (n + pad) // 4
            ends.append(pos)
        got = _LAYOUTS[key] = (torch.tensor(starts, dtype=torch.int64).to(device, non_blocking=True),
                               torch.tensor(ends, dtype=torch.int64).to(device, non_blocking=True), pads)
    return got


def _device_group(bs: list[torch.Tensor]) -> torch.Tensor:
    """One pass over several small tensors of one device: bytes fused, per-tensor sums by prefix sums."""
    device = bs[0].device
    starts, ends, pads = _layout(tuple(b.numel() for b in bs), device)
    pieces = []
    for b, pad in zip(bs, pads, strict=True):
        pieces.append(b)
        if pad:
            pieces.append(_pad(pad, device))
    w = torch.cat(pieces).view(torch.int32).to(torch.int64)  # a new, aligned buffer
    zero = w.new_zeros(1)
    c = torch.cat([zero, torch.cumsum(w, 0)])
    g = torch.cat([zero, torch.cumsum(w * _index(w.numel(), device), 0)])
    s = c[ends] - c[starts]
    return torch.stack([s, g[ends] - g[starts] - (starts - 1) * s], 1)


def device_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(plain, weighted) of each tensor, computed where they live (one device): an (N, 2) int64 tensor
    there. Nothing is read to the host."""
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.int64)
    views = [_byte_view(t) for t in tensors]
    rows: list[torch.Tensor | None] = [None] * len(views)
    large, groups = _plan([(b.numel() + 3) // 4 for b in views])
    for i in large:
        rows[i] = _device_large(views[i])
    for group in groups:
        block = _device_group([views[i] for i in group])
        for j, i in enumerate(group):
            rows[i] = block[j]
    return torch.stack(rows)  # type: ignore[arg-type]


def device_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The two sums of one tensor, on its device: a 2-element int64 tensor (not read)."""
    return device_sums([t])[0]


_NAME_SEEDS: dict[tuple[str, ...], int] = {}


def root_digest(fps: dict[str, int]) -> int:
    """One 64-bit digest of a whole {name: fingerprint} map: the names (cached) seed a hash of the values."""
    names = tuple(fps)
    seed = _NAME_SEEDS.get(names)
    if seed is None:
        seed = _NAME_SEEDS[names] = xxhash.xxh3_64_intdigest("\0".join(names).encode())
    values = np.fromiter(fps.values(), dtype="<u8", count=len(fps)).tobytes()  # 8 bytes each, little-endian
    return xxhash.xxh3_64_intdigest(values, seed)
