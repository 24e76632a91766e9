"""A month-long job's run directory under its budget (issue 48, item 2): the real writers, synthetic steps.

    python bench/run_dir_budget.py                         # 2 ranks x 1.3 M steps, 1,000 tensors, 256M
    python bench/run_dir_budget.py --ranks 4 --steps 200000 --budget 64M

Each rank (a process of its own, as in a job) drives the rank's real event writer (a step record a step, a
finding in every sample's span) and its real fingerprint writer (one fingerprint per tensor a step: a
1,000-tensor model writes 8 KB a step, 10 GB a rank over 1.3 M steps kept whole), within the default
budget. Every 100,000 steps (a thirteenth of a shorter run) it prints the rank's part of the run
directory (all its files, the reserve included) and what the writes cost the writing thread (the
training's): the mean and the worst per step; the background thinning's CPU is printed apart.
Pass: the size is within the budget at every sample; the full-resolution tiers (head, ring, live
file, a segment waiting for the thinner) stay under their constant, (ring + 3) segments a stream, at
every sample (they saw-tooth with the live file's fill, never grow with the steps); the thinned
tiers (summaries, pinned steps, digests), which grow by design until their cap and are then merged
or halved, are each within their cap at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distdebug.artifacts import layout, retention, schema  # noqa: E402
from distdebug.artifacts.writer import RESERVE, EventWriter  # noqa: E402
from distdebug.fingerprint.snapshots import SnapshotWriter  # noqa: E402


def rank_bytes(folder: Path) -> int:
    total = 0
    for f in folder.iterdir():
        try:
            total += f.stat().st_size
        except OSError:
            pass
    return total


def tiers(folder: Path) -> dict[str, int]:
    """Bytes by tier: the whole steps (head, ring, live of both streams) and each thinned file."""
    out = {"whole": 0, "events thinned": 0, "fingerprints thinned": 0, "digests": 0, "other": 0}
    for stream in (folder / layout.EVENTS, folder / layout.FINGERPRINTS):
        for f in layout.stream_files(stream):
            size = f.stat().st_size if f.exists() else 0
            if f == layout.thinned_path(stream):
                out["events thinned" if stream.name == layout.EVENTS else "fingerprints thinned"] += size
            else:
                out["whole"] += size
    roots = folder / layout.FINGERPRINT_ROOTS
    out["digests"] = roots.stat().st_size if roots.exists() else 0
    out["other"] = rank_bytes(folder) - sum(out.values())
    return out


def run_rank(rank: int, run: Path, steps: int, tensors: int, budget: int, out: mp.Queue) -> None:
    events, fingerprints = retention.shares(budget)
    w = EventWriter(layout.events_path(run, rank), reserve=RESERVE, share=events, index=True)  # as a rank
    s = SnapshotWriter(layout.rank_dir(run, rank), share=fingerprints)
    w.write(schema.record(schema.START, rank=rank, world_size=2, attempt=0))
    names = [f"layers.{i // 8}.w{i % 8}.weight" for i in range(tensors)]
    fps = dict.fromkeys(names, 0)
    spent = worst = 0.0
    rows = []
    sample = max(1000, min(100_000, steps // 13))
    cpu0 = time.thread_time()
    for n in range(1, steps + 1):
        fps[names[n % tensors]] = n  # one tensor changes a step: the fingerprints a detector hands the writer
        rec = schema.record(schema.STEP, rank=rank, step=n, attempt=0, time=0.0, loss=2.0 + (n % 97) / 97,
                            step_time_s=2.0, backward_calls=1, collectives=48)
        t = time.perf_counter()
        w.write(rec)
        if n % sample == sample // 2:
            w.write(schema.record(schema.FINDING, rank=rank, step=n, detector="loss_spike", subject="loss",
                                  severity="warning", message="synthetic"))
            s.pins.add(n)
        s.write(n, fps)
        dt = time.perf_counter() - t
        spent += dt
        worst = max(worst, dt)
        if n % sample == 0 or n == steps:
            folder = layout.rank_dir(run, rank)
            rows.append((n, rank_bytes(folder), tiers(folder)["whole"], spent / n * 1e6, worst * 1e3))
    w.close()
    s.close()
    writing_cpu = time.thread_time() - cpu0
    out.put((rank, rows, time.process_time() - writing_cpu, tiers(layout.rank_dir(run, rank))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=1_300_000)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--budget", default="256M")
    args = p.parse_args()
    budget = retention.parse_size(args.budget)
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        run = Path(tmp)
        q: mp.Queue = mp.Queue()
        procs = [mp.Process(target=run_rank, args=(r, run, args.steps, args.tensors, budget, q))
                 for r in range(args.ranks)]
        t0 = time.perf_counter()
        for proc in procs:
            proc.start()
        results = sorted(q.get() for _ in procs)
        for proc in procs:
            proc.join()
        wall = time.perf_counter() - t0
        files = max(len(list(d.iterdir())) for _, d in layout.rank_dirs(run))
    print(f"{args.ranks} ranks x {args.steps:,} steps, {args.tensors:,} tensors ({16 + 8 * args.tensors:,} B of "
          f"fingerprints a step), budget {retention.size_text(budget)} a rank; {wall:.0f} s")
    ok = True
    events, fingerprints = retention.shares(budget)
    caps = {"events thinned": events.thinned, "fingerprints thinned": fingerprints.thinned,
            "digests": fingerprints.roots}
    for rank, rows, thinner_cpu, end in results:
        print(f"rank {rank}:        step   rank dir (MiB)   whole steps (MiB)   writes: mean us/step   worst ms")
        for n, size, whole, mean, worst in rows:
            print(f"        {n:>12,}   {size / 2**20:>14.1f}   {whole / 2**20:>17.1f}   {mean:>20.1f}   {worst:>8.1f}")
        sizes = [size for _, size, _, _, _ in rows]
        wholes = [whole for _, _, whole, _, _ in rows]
        bound = (events.ring + 3) * events.segment + (fingerprints.ring + 3) * fingerprints.segment
        after = wholes[len(wholes) // 4:]
        within, flat = max(sizes) <= budget, max(wholes) <= bound
        capped = all(end[k] <= cap for k, cap in caps.items())
        ok &= within and flat and capped
        print(f"  largest {max(sizes) / 2**20:.1f} MiB ({'within' if within else 'OVER'} the budget); whole steps "
              f"after a quarter of the run {min(after) / 2**20:.1f}-{max(after) / 2**20:.1f} MiB, at most "
              f"{bound / 2**20:.1f} ({'bounded' if flat else 'OVER'}); "
              "thinned tiers at the end: " + ", ".join(f"{k} {end[k] / 2**20:.1f} of {caps[k] / 2**20:.1f} MiB"
                                                       for k in caps) + f" ({'within' if capped else 'OVER'} "
              f"their caps); background thinning: {thinner_cpu:.1f} s of CPU ({thinner_cpu / args.steps * 1e6:.1f} "
              "us a step)")
    print(f"files per rank at the end: {files}")
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
