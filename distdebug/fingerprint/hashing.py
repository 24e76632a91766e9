"""Fingerprints of tensors that change when any bit changes.

- CPU tensors: xxh3-64 over the raw bytes (zero-copy through numpy), seeded with dtype and shape so
  that equal bytes under another dtype or shape never compare equal.
- Device tensors: a fingerprint computed on the device (``device_fingerprint``) so that only 16
  bytes per tensor cross to the host: two integer sums over the tensor's 32-bit words, one plain
  and one position-weighted. Any single-bit change alters the plain sum (it moves one word by
  +-2^k); the weighted sum also catches words that trade places.

DTensor (FSDP2) shards are fingerprinted as the local shard; non-contiguous tensors are made
contiguous first (a copy, only for them).
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

_MASK64 = (1 << 64) - 1
_ROW = 4096  # words per row of the weighted sum; bounds the temporary to one row block


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds: a DTensor's local shard, detached, contiguous."""
    to_local = getattr(t, "to_local", None)
    if callable(to_local):
        t = to_local()
    t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def _header(t: torch.Tensor) -> bytes:
    return f"{t.dtype}|{tuple(t.shape)}".encode()


def cpu_fingerprint(t: torch.Tensor) -> int:
    """xxh3-64 of dtype, shape and raw bytes of a CPU tensor (any dtype, including bf16 and bool)."""
    t = local_view(t)
    h = xxhash.xxh3_64(_header(t))
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.intdigest()


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int64 values of 32-bit words (zero-padded to a multiple of 4 bytes)."""
    b = t.reshape(-1).view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
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


def combine_device(fp: Any, t: torch.Tensor) -> int:
    """Fold a device fingerprint (two int64 on the host) with dtype and shape into one 64-bit int."""
    a, b = (int(x) & _MASK64 for x in fp)
    return xxhash.xxh3_64(_header(t) + a.to_bytes(8, "little") + b.to_bytes(8, "little")).intdigest()


def fingerprints(named: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Fingerprint many tensors: CPU ones by xxh3, device ones on the device with one host transfer."""
    out: dict[str, int] = {}
    device_items: list[tuple[str, torch.Tensor]] = []
    for name, t in named:
        if local_view(t).device.type == "cpu":
            out[name] = cpu_fingerprint(t)
        else:
            device_items.append((name, t))
    if device_items:
        stacked = torch.stack([device_fingerprint(t) for _, t in device_items]).cpu()  # one copy, 16 B each
        for (name, t), fp in zip(device_items, stacked.tolist(), strict=True):
            out[name] = combine_device(fp, t)
    return out


def root_digest(fps: dict[str, int]) -> int:
    """One 64-bit digest of a whole {name: fingerprint} map (order-independent of insertion)."""
    h = xxhash.xxh3_64()
    for name in sorted(fps):
        h.update(name.encode())
        h.update(fps[name].to_bytes(8, "little"))
    return h.intdigest()
