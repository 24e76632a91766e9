"""Fingerprints of tensors that change when any bit changes.

- CPU tensors: xxh3-64 over the raw bytes (zero-copy, from the data pointer), seeded with dtype and shape so
  that equal bytes under another dtype or shape never compare equal. Tensors over CHUNK bytes are
  hashed in fixed-size chunks on a few threads (xxhash releases the GIL) and the chunk digests are
  hashed in order: the result does not depend on the number of threads, only on the bytes.
- Device tensors: a fingerprint computed on the device (``device_fingerprint``) so that only 16
  bytes per tensor cross to the host: two integer sums over the tensor's 32-bit words, one plain
  and one position-weighted. Any single-bit change alters the plain sum (it moves one word by
  +-2^k); the weighted sum also catches words that trade places.

DTensor (FSDP2) shards are fingerprinted as the local shard; non-contiguous tensors are made
contiguous first (a copy, only for them).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import xxhash

_MASK64 = (1 << 64) - 1
CHUNK = 2 << 20  # bytes per parallel piece of a large tensor
SMALL = 64 << 10  # tensors up to this size are copied to bytes and hashed at once
_POOL: Any = None


def _pool() -> Any:
    global _POOL
    if _POOL is None:
        import os
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                   thread_name_prefix="distdebug-hash")
    return _POOL


def _xxh(chunk: Any) -> bytes:
    return xxhash.xxh3_64(chunk).digest()
_ROW = 4096  # words per row of the weighted sum; bounds the temporary to one row block


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
    key = (t.dtype, t.shape)
    seed = _SEEDS.get(key)
    if seed is None:
        seed = _SEEDS[key] = xxhash.xxh3_64_intdigest(f"{t.dtype}|{tuple(t.shape)}".encode())
    return seed


def _bytes(t: torch.Tensor) -> Any:
    """A zero-copy byte view of a contiguous CPU tensor, taken from its data pointer.

    Not ``Tensor.numpy()``: exporting to numpy marks the storage as non-resizable for good, and FSDP2
    frees its gathered parameters with ``storage.resize_(0)``: hashing them that way breaks training.
    The view does not keep the tensor alive: callers hold the tensor until the hash is done.
    """
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def _pieces(t: torch.Tensor) -> tuple[int, list[Any], torch.Tensor]:
    """Seed, byte pieces (one, or CHUNK-sized when larger) and the tensor they view (keep it alive)."""
    t = local_view(t)
    if not t.numel():
        return _seed(t), [], t
    data = _bytes(t)
    if data.nbytes <= CHUNK:
        return _seed(t), [data], t
    return _seed(t), [data[i:i + CHUNK] for i in range(0, data.nbytes, CHUNK)], t


def _finish(seed: int, pieces: list[Any], digests: list[bytes] | None) -> int:
    if digests is None:
        return xxhash.xxh3_64_intdigest(pieces[0] if pieces else b"", seed)
    return xxhash.xxh3_64_intdigest(b"".join(digests), seed)


def cpu_fingerprint(t: torch.Tensor) -> int:
    """xxh3-64 (seeded with dtype and shape) of a CPU tensor's raw bytes; any dtype, bf16 and bool too."""
    seed, pieces, _view = _pieces(t)
    if len(pieces) > 1:
        return _finish(seed, pieces, list(_pool().map(_xxh, pieces)))
    return _finish(seed, pieces, None)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int64 values of 32-bit words (zero-padded to a multiple of 4 bytes)."""
    b = t.reshape(-1).view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])  # a new, aligned tensor
    elif b.storage_offset() % 4:
        # A 2-byte tensor at an odd element offset (a slice of a bf16/fp16 flat buffer: ZeRO's, DDP's
        # bucket views) cannot be viewed as 32-bit words in place: copy its bytes to aligned memory.
        b = b.clone()
    return b.view(torch.int32).to(torch.int64)


def device_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums computed where the tensor lives; returns a 2-element int64 tensor on its device."""
    t = local_view(t)
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    w = _words(t)
    plain = w.sum()
    n = w.numel()
    rows = (n + _ROW - 1) // _ROW
    if rows * _ROW != n:
        w = torch.cat([w, w.new_zeros(rows * _ROW - n)])
    w = w.view(rows, _ROW)
    col = torch.arange(1, _ROW + 1, device=t.device, dtype=torch.int64)
    row = torch.arange(1, rows + 1, device=t.device, dtype=torch.int64) * 1_000_003
    weighted = ((w * col).sum(1) * row).sum()
    return torch.stack([plain, weighted])


def combine_device(fp: Any, t: torch.Tensor | int) -> int:
    """Fold a device fingerprint (two int64 on the host) with dtype and shape (the tensor, or its
    ``shape_seed``, which needs no reference to the tensor) into one 64-bit int."""
    a, b = (int(x) & _MASK64 for x in fp)
    return xxhash.xxh3_64_intdigest(a.to_bytes(8, "little") + b.to_bytes(8, "little"),
                                    t if isinstance(t, int) else _seed(t))


def shape_seed(t: torch.Tensor) -> int:
    """What a fingerprint folds in besides the bytes (dtype and shape): host metadata, no device read."""
    return _seed(t)


def fingerprints(named: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Fingerprint many tensors: CPU ones by xxh3, device ones on the device with one host transfer."""
    out: dict[str, int] = {}
    device_items: list[tuple[str, torch.Tensor]] = []
    chunked: list[tuple[str, int, list[Any], torch.Tensor]] = []
    for name, t in named:
        kind = type(t)
        if (kind is torch.Tensor or kind is torch.nn.Parameter) and t.is_cpu and t.is_contiguous():
            n = t.nbytes
            if 0 < n <= SMALL:  # the common case, kept short: a copy of a few KiB costs less than a view
                out[name] = xxhash.xxh3_64_intdigest(ctypes.string_at(t.data_ptr(), n), _seed(t))
                continue
        elif not t.is_cpu:
            device_items.append((name, t))
            continue
        seed, pieces, view = _pieces(t)
        if len(pieces) > 1:
            chunked.append((name, seed, pieces, view))  # the view stays referenced until hashed
        else:
            out[name] = _finish(seed, pieces, None)
    if chunked:
        # All large tensors' pieces in one batch, so that every hashing thread stays busy.
        flat = [p for _, _, pieces, _ in chunked for p in pieces]
        digests = iter(list(_pool().map(_xxh, flat)))
        for name, seed, pieces, _ in chunked:
            out[name] = _finish(seed, pieces, [next(digests) for _ in pieces])
    if device_items:
        stacked = torch.stack([device_fingerprint(t) for _, t in device_items]).cpu()  # one copy, 16 B each
        for (name, t), fp in zip(device_items, stacked.tolist(), strict=True):
            out[name] = combine_device(fp, t)
    return {name: out[name] for name, _ in named}  # the caller's order (tensor order names the first)


_NAME_SEEDS: dict[tuple[str, ...], int] = {}


def root_digest(fps: dict[str, int]) -> int:
    """One 64-bit digest of a whole {name: fingerprint} map: the names (cached) seed a hash of the values."""
    names = tuple(fps)
    seed = _NAME_SEEDS.get(names)
    if seed is None:
        seed = _NAME_SEEDS[names] = xxhash.xxh3_64_intdigest("\0".join(names).encode())
    values = b"".join(v.to_bytes(8, "little") for v in fps.values())
    return xxhash.xxh3_64_intdigest(values, seed)
