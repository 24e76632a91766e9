"""Fingerprint throughput against one plain read pass and against md5/sha1, side by side in one run.

    python bench/fingerprint_throughput.py            # 256 MiB in a model-like mix of tensor sizes
    python bench/fingerprint_throughput.py --mib 1024

Targets (issue 18): at least 0.8 of the read pass (torch.sum over the same tensors) at the same thread
count, and at least 20 times md5, all at one thread (the fingerprint has no thread pool: its CPU path
is numpy on the calling thread). xxh3 over the raw bytes is printed beside it as the reference of what
an exact hash reaches here. Each method runs --repeat times, interleaved,
and the best time counts (the least disturbed by other load on the machine).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import xxhash  # noqa: E402

from distdebug.fingerprint.pending import fingerprints  # noqa: E402


def model_like(total_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """Big matrices, medium vectors and many small tensors, as in a transformer's state dict."""
    g = torch.Generator().manual_seed(0)
    out, used, i = [], 0, 0
    sizes = [4 << 20, 1 << 20, 64 << 10, 4 << 10, 256]
    while used < total_bytes:
        n = sizes[i % len(sizes)] // 4
        out.append((f"t{i}", torch.randn(n, generator=g)))
        used += n * 4
        i += 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    named = model_like(args.mib << 20)
    arrays = [t.numpy() for _, t in named]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    methods = {
        "read pass (torch.sum)": lambda: [t.sum() for _, t in named],
        "distdebug fingerprints": lambda: fingerprints(named),
        "xxh3 over the bytes (reference)": lambda: [xxhash.xxh3_64_intdigest(a) for a in arrays],
        "md5": lambda: [hashlib.md5(a).digest() for a in arrays],
        "sha1": lambda: [hashlib.sha1(a).digest() for a in arrays],
    }
    best = {k: float("inf") for k in methods}
    for _ in range(args.repeat):
        for name, fn in methods.items():
            if name in ("md5", "sha1") and best[name] < float("inf") and _ > 1:
                continue  # slow and steady: two samples are enough
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    # Both sides at one thread, said: torch's intra-op pool (the read pass and the device path) is set to
    # 1 above; the fingerprint's CPU path is numpy, single-threaded, with no pool of its own; xxh3 and
    # the hashlib digests are one call on one thread.
    print(f"{len(named)} tensors, {nbytes / 2**20:.0f} MiB; threads: torch {torch.get_num_threads()}, "
          "fingerprint 1 (numpy, no pool), md5/sha1 1")
    for name, t in best.items():
        print(f"  {name:32s} {nbytes / t / 1e9:7.2f} GB/s")
    read, fp, md5 = best["read pass (torch.sum)"], best["distdebug fingerprints"], best["md5"]
    print(f"fingerprints / read pass = {read / fp:.2f} (target >= 0.8); fingerprints / md5 = {md5 / fp:.1f}x "
          f"(target >= 20)")


if __name__ == "__main__":
    main()
