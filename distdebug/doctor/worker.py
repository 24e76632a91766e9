"""The per-rank side of ``distdebug doctor --nproc-per-node N``: run under attach like any script.

Every rank runs the host checks and reports its environment; rank 0 compares them (a variable or a
version that differs across ranks or nodes is the classic "works on one node" failure). With
``--bandwidth``: an all_reduce bus-bandwidth sweep in the style of nccl-tests' all_reduce_perf
(sizes from 8 B doubling to ``--max-bytes``; busbw = algbw x 2(n-1)/n), then a pairwise send/recv
matrix (bandwidth of a ping-pong of PAIR_BYTES, latency of an 8-byte ping-pong) that flags links
far slower than the median link. Rank 0 writes everything to ``doctor.json`` in the run directory
and reports what it finds as findings (detectors ``env_diff`` and ``link_matrix``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from distdebug import strictjson

PAIR_BYTES = 4 << 20
SLOW_LINK = 3.0  # a link this many times slower than the median link is flagged
COMPARED = ("NCCL_", "TORCH_NCCL_", "GLOO_", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR",
            "PYTORCH_CUDA_ALLOC_CONF", "LD_LIBRARY_PATH")


def compared_env(env: dict[str, str]) -> dict[str, str]:
    from distdebug.artifacts.redact import redact_env

    return redact_env({k: v for k, v in env.items() if any(k.startswith(p) or k == p for p in COMPARED)})


def env_differences(per_rank: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Variables and versions that are not the same on every rank: [{name, values: {value: [ranks]}}]."""
    out = []
    keys = sorted({k for r in per_rank.values() for k in r["env"]})
    for key in keys:
        values: dict[str, list[int]] = {}
        for rank, r in sorted(per_rank.items()):
            values.setdefault(r["env"].get(key, "<unset>"), []).append(rank)
        if len(values) > 1:
            out.append({"name": key, "values": values})
    versions: dict[str, list[int]] = {}
    for rank, r in sorted(per_rank.items()):
        versions.setdefault(r["versions"], []).append(rank)
    if len(versions) > 1:
        out.append({"name": "versions", "values": versions})
    return out


def slow_links(matrix: dict[tuple[int, int], float]) -> list[tuple[int, int, float]]:
    """Pairs whose bandwidth is SLOW_LINK times or more below the median pair's: (a, b, times slower)."""
    if len(matrix) < 2:
        return []
    median = statistics.median(matrix.values())
    return [(a, b, median / bw) for (a, b), bw in sorted(matrix.items()) if bw > 0 and median / bw >= SLOW_LINK]


def _timed(fn: Any, sync: Any, iters: int, best: bool = False) -> float:
    """Median seconds per call (best: the fastest call, what the link can do when nothing else runs)."""
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times) if best else statistics.median(times)


def _progress(rank: int, label: str, done: int, total: int, unit: str) -> None:
    """A text progress bar on rank 0's stderr (the ranks' output passes through the launcher)."""
    if rank != 0:
        return
    bar = int(30 * done / total)
    end = "\n" if done == total else ""
    print(f"\r{label} [{'#' * bar}{'.' * (30 - bar)}] {done}/{total} {unit}", end=end, file=sys.stderr, flush=True)


def sweep(dist: Any, device: Any, max_bytes: int, rank: int, world: int) -> list[dict[str, float]]:
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows, size = [], 8
    sizes = []
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    for i, nbytes in enumerate(sizes):
        t = torch.ones(max(nbytes // 4, 1), device=device)
        dist.all_reduce(t)  # warm-up
        iters = 20 if nbytes <= 1 << 20 else 5
        dist.barrier()
        secs = _timed(lambda t=t: dist.all_reduce(t), sync, iters)
        algbw = nbytes / secs / 1e9
        rows.append({"bytes": nbytes, "time_us": secs * 1e6, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * 2 * (world - 1) / world})
        _progress(rank, "all_reduce sweep", i + 1, len(sizes), "sizes")
    return rows


def pair_matrix(dist: Any, device: Any, rank: int, world: int, pair_bytes: int) -> dict[str, Any]:
    """Bandwidth (GB/s) and latency (us) of every pair, measured one pair at a time."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    big = torch.ones(pair_bytes // 4, device=device)
    small = torch.ones(2, device=device)
    bw: dict[str, float] = {}
    lat: dict[str, float] = {}
    pairs = [(a, b) for a in range(world) for b in range(a + 1, world)]
    for n, (a, b) in enumerate(pairs):
        if rank in (a, b):
            peer = b if rank == a else a

            def ping(t: Any, peer: int = peer, first: bool = rank == a) -> None:
                if first:
                    dist.send(t, peer)
                    dist.recv(t, peer)
                else:
                    dist.recv(t, peer)
                    dist.send(t, peer)

            ping(big)  # warm-up
            # The fastest of several: a link is judged by what it can do, not by a moment of contention.
            secs = _timed(lambda: ping(big), sync, 5, best=True)
            lat_s = _timed(lambda: ping(small), sync, 10, best=True)
            bw[f"{a}-{b}"] = 2 * pair_bytes / secs / 1e9
            lat[f"{a}-{b}"] = lat_s / 2 * 1e6
        dist.barrier()
        _progress(rank, "link matrix", n + 1, len(pairs), "pairs")
    gathered: list[Any] = [None] * world  # each pair was measured by its two ranks only
    dist.all_gather_object(gathered, (bw, lat))
    for their_bw, their_lat in gathered:
        bw.update(their_bw)
        lat.update(their_lat)
    return {"bandwidth_GBps": dict(sorted(bw.items())), "latency_us": dict(sorted(lat.items()))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="where rank 0 writes doctor.json (default: the attach run "
                                                 "directory, else the current one)")
    p.add_argument("--bandwidth", action="store_true")
    p.add_argument("--max-bytes", type=int, default=128 << 20)
    p.add_argument("--pair-bytes", type=int, default=PAIR_BYTES)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from distdebug.doctor.checks import local_checks

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    checks = local_checks()
    mine = {"host": socket.gethostname(), "node": int(os.environ.get("GROUP_RANK", 0)),
            "checks": [c.to_dict() for c in checks], "env": compared_env(dict(os.environ)),
            "versions": next(c.detail for c in checks if c.name == "versions")}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    result: dict[str, Any] = {"world_size": world, "backend": dist.get_backend(),
                              "ranks": {str(r): g for r, g in enumerate(gathered)}}
    result["differences"] = env_differences(dict(enumerate(gathered)))
    if args.bandwidth:
        result["all_reduce"] = sweep(dist, device, args.max_bytes, rank, world)
        result["links"] = pair_matrix(dist, device, rank, world, args.pair_bytes)
    if rank == 0:
        _report(result)
        from distdebug import envvars
        from distdebug.artifacts import layout
        from distdebug.artifacts.redact import Redactor

        out = args.out or str(layout.doctor_path(Path(envvars.get(envvars.RUN_DIR) or ".")))

        Path(out).write_text(Redactor()(strictjson.dumps(result, indent=2)))
    dist.destroy_process_group()


def _report(result: dict[str, Any]) -> None:
    """Rank 0's findings, through the attach session (written to its event stream)."""
    from distdebug.findings import Finding, Severity
    from distdebug.runtime.session import current_session

    session = current_session()
    if session is None:
        return
    for d in result["differences"]:
        session.report(Finding(
            severity=Severity.WARNING, detector="env_diff", ranks=sorted(r for rs in d["values"].values() for r in rs),
            step=None, subject=d["name"],
            message=f"{d['name']} differs across ranks: " + "; ".join(f"{v!r} on ranks {rs}"
                                                                      for v, rs in d["values"].items()),
            fix="the same software and variables on every node (one container image, one launcher environment)",
        ))
    links = result.get("links")
    if links:
        matrix = {tuple(int(x) for x in k.split("-")): v for k, v in links["bandwidth_GBps"].items()}
        median = statistics.median(matrix.values()) if matrix else 0.0
        for a, b, times in slow_links(matrix):  # type: ignore[arg-type]
            session.report(Finding(
                severity=Severity.WARNING, detector="link_matrix", ranks=[a, b], step=None, subject=f"link {a}-{b}",
                message=f"the link between ranks {a} and {b} is {times:.1f}x slower than the median link "
                        f"({matrix[(a, b)]:.3g} GB/s against {median:.3g} GB/s)",
                evidence={"bandwidth_GBps": matrix[(a, b)], "median_GBps": median},
                fix="check that pair's cabling, PCIe/NVLink path (nvidia-smi topo -m) and NIC; "
                    "NCCL_DEBUG=INFO shows the transport each pair uses",
            ))


if __name__ == "__main__":
    main()
