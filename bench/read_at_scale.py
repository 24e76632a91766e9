"""Reading a thousand ranks' long run (issue 48, item 4): report, report --json, diff, top, each on 1,024
ranks x 100,000 steps written by the real writers, within 10 s and 2 GB.

    python bench/read_at_scale.py                          # 1,024 ranks x 100,000 steps, 8 nodes (~25 min)
    python bench/read_at_scale.py --ranks 64 --steps 20000 # a quick look
    python bench/read_at_scale.py --dir /data/ras --reuse  # read again what an earlier run wrote

Writing: a rank drives the rank's real event writer (with its index, as attach runs it) and its real
fingerprint writer (with its blocks) within a run-directory budget: a step record, a fingerprint per tensor a
step, a memory and a harness-cost record every 100 steps, a few findings. Writing 1,024 ranks x 100,000 steps
so takes about an hour of this machine's two cores, so ``--templates`` ranks (64, and rank 517) are written
so, and each other rank's folder is a copy of one of them (every file, as large), with its identity (rank,
node, host, the ranks its findings name) rewritten in the small files a reader at scale reads (its essential
records, its index): what is read is each rank's own, what is not read is as large as it would be.
``--templates 1024`` writes every rank for real. The job is laid out as its nodes
would write it without a shared file system: one run directory per node (a manifest, a node file, its
ranks), plus a directory that holds every rank (links to the nodes' folders), as a shared one would. Rank
517's tensor 5 departs from the others at step 97,000 (the online check's finding pins the step), so diff
has something to find.

Reading: each command runs in a process of its own, as a user runs it; printed are its wall time and its
largest resident memory (the kernel's count for that process), and its answer is checked: every rank and
step reported, the departure found at its rank, step and tensor. Run twice, the second read is from the
page cache, the first mostly too (the files were just written): ``--cold`` drops the caches first (root).
Pass: each within 10 s and 2 GB.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distdebug.artifacts import layout, retention, schema  # noqa: E402
from distdebug.artifacts.writer import RESERVE, EventWriter, write_json_atomic  # noqa: E402
from distdebug.fingerprint.snapshots import SnapshotWriter  # noqa: E402

ODD_RANK, ODD_STEP, ODD_TENSOR = 517, 97_000, 5
LIMIT_S, LIMIT_BYTES = 10.0, 2 << 30


def node_dir(root: Path, node: int) -> Path:
    return root / f"node-{node}"


def write_rank(job: tuple[int, Path, int, int, int, int]) -> int:
    rank, folder_root, world, per_node, steps, tensors = job
    node = rank // per_node
    run = node_dir(folder_root, node)
    budget = int(os.environ["READ_AT_SCALE_BUDGET"])
    events, fingerprints = retention.shares(budget)
    w = EventWriter(layout.events_path(run, rank), reserve=RESERVE, share=events, index=True)
    s = SnapshotWriter(layout.rank_dir(run, rank), share=fingerprints)
    w.write(schema.record(schema.START, rank=rank, local_rank=rank % per_node, node=node, world_size=world,
                          host=f"node{node}", pid=1000 + rank, attempt=0, time=0.0))
    w.write(schema.record(schema.DISCOVERY, rank=rank, models=[{"name": "model", "wrapper": "ddp", "parameters": 1}],
                          optimizers=[], process_group={"backend": "nccl", "world_size": world}))
    names = [f"layers.{i // 4}.w{i % 4}.weight" for i in range(tensors)]
    fps = {n: i for i, n in enumerate(names)}
    for n in range(1, steps + 1):
        for i, name in enumerate(names):
            fps[name] = (n * 2654435761 + i) & 0xFFFFFFFFFFFF
        if rank == ODD_RANK and n >= ODD_STEP:
            fps[names[ODD_TENSOR]] ^= 1
        w.write(schema.record(schema.STEP, rank=rank, step=n, attempt=0, time=n * 2.0,
                              loss=round(2.0 + 1.0 / n + (n * 7919 % 97) / 970, 6),
                              step_time_s=round(2.0 + (n * 31 + rank) % 17 / 1000, 6), backward_calls=1,
                              collectives=48))
        if n % 100 == 0:
            w.write(schema.record(schema.MEMORY, rank=rank, step=n, time=n * 2.0, parameters=1 << 30,
                                  gradients=1 << 30, optimizer_state=2 << 30, activations=(3 << 30) + n % 1000,
                                  other=0, total=(7 << 30) + n % 1000))
            w.write(schema.record(schema.HARNESS_COST, rank=rank, time=n * 2.0, steps=n,
                                  training_thread_ms={"session": n * 0.05, "replica_divergence": n * 0.04}))
        if rank == ODD_RANK and n == ODD_STEP:
            w.write(schema.record(schema.FINDING, rank=rank, step=n, time=n * 2.0, detector="replica_divergence",
                                  subject=names[ODD_TENSOR], severity="error", ranks=[rank],
                                  message=f"{names[ODD_TENSOR]} differs on rank {rank}"))
            s.pins.add(n)
        if n % 25_000 == 12_345 and rank % 64 == 3:
            w.write(schema.record(schema.FINDING, rank=rank, step=n, time=n * 2.0, detector="loss_spike",
                                  subject="loss", severity="warning", ranks=[rank], message="a spike"))
        s.write(n, fps)
    w.write(schema.record(schema.END, rank=rank, exit_code=0, steps=steps, time=steps * 2.0))
    w.close()
    s.close()
    return rank


def copy_rank(root: Path, template: int, rank: int, per_node: int) -> None:
    """A template rank's folder as rank ``rank``'s: the streams copied as they are, the identity (rank, node, host,
    pid, the ranks a finding names) rewritten in the records the readers read (the essential file, the index)."""
    src = layout.rank_dir(node_dir(root, template // per_node), template)
    dst = layout.rank_dir(node_dir(root, rank // per_node), rank)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    node = rank // per_node

    def own(r: dict) -> dict:
        r = dict(r)
        if "rank" in r:
            r["rank"] = rank
        if r.get("ranks") == [template]:
            r["ranks"] = [rank]
        if r.get("kind") == schema.START:
            r.update(node=node, local_rank=rank % per_node, host=f"node{node}", pid=1000 + rank)
        return r

    for f in src.iterdir():
        if f.name == layout.ESSENTIAL:
            lines = [json.dumps(own(json.loads(raw)), separators=(",", ":")) for raw in f.read_text().splitlines()]
            (dst / f.name).write_text("".join(line + "\n" for line in lines))
        elif f.name == layout.INDEX:
            index = json.loads(f.read_text())
            index["digest"]["recent"] = [[i, own(r)] for i, r in index["digest"]["recent"]]
            index["pos"]["ino"] = 0  # another file: the position is found by its segment number and offset
            index["essential_bytes"] = (dst / layout.ESSENTIAL).stat().st_size if (dst / layout.ESSENTIAL).exists() \
                else None
            (dst / f.name).write_text(json.dumps(index))
        else:
            shutil.copyfile(f, dst / f.name)
    index = json.loads((dst / layout.INDEX).read_text())  # the essential file may have been copied after it
    index["essential_bytes"] = (dst / layout.ESSENTIAL).stat().st_size
    (dst / layout.INDEX).write_text(json.dumps(index))


def write_job(root: Path, ranks: int, nodes: int, steps: int, tensors: int, budget: int, templates: int) -> float:
    per_node = ranks // nodes
    shared = root / "shared"
    for node in range(nodes):
        run = node_dir(root, node)
        run.mkdir(parents=True, exist_ok=True)
        write_json_atomic(layout.manifest_path(run), {
            "schema": schema.MANIFEST_SCHEMA, "command": ["distdebug", "attach", "train.py"], "target": "train.py",
            "target_args": [], "launcher": {"nnodes": nodes, "nproc_per_node": per_node, "rdzv_backend": "c10d",
                                            "rdzv_endpoint": "node0:29500", "rdzv_id": "bench"}})
        write_json_atomic(layout.node_path(run, node), {"node_rank": node, "host": f"node{node}", "started": 0.0,
                                                        "ended": steps * 2.0, "exit_code": 0})
    os.environ["READ_AT_SCALE_BUDGET"] = str(budget)
    t0 = time.perf_counter()
    real = sorted(set(range(min(templates, ranks))) | {ODD_RANK})
    jobs = [(r, root, ranks, per_node, steps, tensors) for r in real]
    with mp.Pool(max(1, min(os.cpu_count() or 1, 8))) as pool:
        for done, _ in enumerate(pool.imap_unordered(write_rank, jobs, chunksize=1), 1):
            if done % max(1, len(real) // 8) == 0:
                print(f"  written {done}/{len(real)} ranks ({time.perf_counter() - t0:.0f} s)", flush=True)
    plain = [r for r in real if r != ODD_RANK]
    for rank in range(ranks):
        if rank not in real:
            copy_rank(root, plain[rank % len(plain)], rank, per_node)
    shared.mkdir(exist_ok=True)
    shutil.copy(layout.manifest_path(node_dir(root, 0)), layout.manifest_path(shared))
    (shared / "nodes").mkdir(exist_ok=True)
    for node in range(nodes):
        shutil.copy(layout.node_path(node_dir(root, node), node), layout.node_path(shared, node))
        for rank, folder in layout.rank_dirs(node_dir(root, node)):
            link = layout.rank_dir(shared, rank)
            if not link.exists():
                link.symlink_to(folder.resolve(), target_is_directory=True)
    (root / "done.json").write_text(json.dumps({"ranks": ranks, "nodes": nodes, "steps": steps, "tensors": tensors,
                                                "budget": budget}))
    return time.perf_counter() - t0


def timed(args: list[str], scratch: Path) -> tuple[float, int, str]:
    """(wall s, largest resident bytes, stdout) of one command in a process of its own: its own peak, from the
    kernel's accounting of that child (wait4), its output through a file (a pipe would stall it)."""
    out, err = scratch / "stdout", scratch / "stderr"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "distdebug", *args], stdout=fo, stderr=fe,
                             env={**os.environ, "COLUMNS": "120"})
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args)} failed ({p.returncode}): {err.read_text()[-2000:]}")
    return wall, usage.ru_maxrss * 1024, out.read_text()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--tensors", type=int, default=24)
    p.add_argument("--budget", default="16M", help="each rank's run-directory budget (16M: 16 GB for the job)")
    p.add_argument("--templates", type=int, default=64,
                   help="ranks written by the real writers (and rank 517); the others are their copies")
    p.add_argument("--dir", default=None, help="where to write (default: a new folder here, removed at the end)")
    p.add_argument("--reuse", action="store_true", help="read what an earlier run wrote to --dir")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each read (root)")
    args = p.parse_args()
    odd_rank = ODD_RANK if args.ranks > ODD_RANK else args.ranks - 1
    odd_step = ODD_STEP if args.steps >= ODD_STEP else args.steps - args.steps // 30
    budget = retention.parse_size(args.budget)
    root = Path(args.dir) if args.dir else Path(f"read-at-scale-{os.getpid()}")
    keep = args.dir is not None
    try:
        done = root / "done.json"
        if not (args.reuse and done.exists()):
            if root.exists():
                shutil.rmtree(root)
            print(f"writing {args.ranks:,} ranks x {args.steps:,} steps ({args.tensors} tensors, budget "
                  f"{retention.size_text(budget)} a rank, {args.nodes} nodes) into {root}", flush=True)
            globals().update(ODD_RANK=odd_rank, ODD_STEP=odd_step)
            wall = write_job(root, args.ranks, args.nodes, args.steps, args.tensors, budget, args.templates)
            size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
            print(f"written in {wall:.0f} s: {size / 2**30:.1f} GiB", flush=True)
        meta = json.loads(done.read_text())
        ranks, steps = meta["ranks"], meta["steps"]
        odd_rank = ODD_RANK if ranks > ODD_RANK else ranks - 1
        odd_step = ODD_STEP if steps >= ODD_STEP else steps - steps // 30
        nodes = [str(node_dir(root, n)) for n in range(meta["nodes"])]
        shared = str(root / "shared")
        checks = [
            ("report (one shared run directory)", ["report", shared], lambda out: f"{ranks}" in out),
            ("report --json (one shared run directory)", ["report", "--json", shared], "json"),
            (f"report, {len(nodes)} nodes' directories merged", ["report", *nodes], lambda out: f"{ranks}" in out),
            (f"report --json, {len(nodes)} nodes merged", ["report", "--json", *nodes], "json"),
            ("diff (ranks against ranks)", ["diff", "--json", shared], "diff"),
            (f"diff, {len(nodes)} nodes", ["diff", "--json", nodes[0], *[a for n in nodes[1:] for a in ("--node", n)]],
             "diff"),
            ("top --once --json", ["top", "--once", "--json", shared], "top"),
            ("report --html (one shared run directory)", ["report", "--html", str(root / "report.html"), shared],
             lambda out: (root / "report.html").stat().st_size > 0),
        ]
        ok = True
        print(f"{'command':<44} {'wall s':>7} {'max RSS MiB':>12}  answer")
        for label, argv, check in checks:
            if args.cold:
                subprocess.run(["sync"], check=False)
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            wall, rss, out = timed(argv, root)
            if check == "json":
                data = json.loads(out)
                good = (len(data["ranks"]) == ranks and all(r["steps"] == steps for r in data["ranks"])
                        and any(f["detector"] == "replica_divergence" for f in data["findings"]))
                answer = f"{len(data['ranks'])} ranks, last step {data['ranks'][-1]['steps']:,}"
            elif check == "diff":
                data = json.loads(out)
                t = (data.get("tensors") or [{}])[0]
                good = data.get("step") == odd_step and t.get("ranks") == [odd_rank] and t.get("tensor", "").endswith(
                    f"w{ODD_TENSOR % 4}.weight")
                answer = f"step {data.get('step')}, rank(s) {t.get('ranks')}, {t.get('tensor')}; {data.get('read')}"
            elif check == "top":
                data = json.loads(out)
                rows = data["ranks"] if isinstance(data, dict) else data
                good = len(rows) == ranks and all(r["step"] == steps for r in rows)
                answer = f"{len(rows)} rows, step {rows[-1]['step']:,}"
            else:
                good = check(out)
                answer = out.strip().splitlines()[0][:60] if out.strip() else ""
            within = wall <= LIMIT_S and rss <= LIMIT_BYTES
            ok &= good and within
            print(f"{label:<44} {wall:>7.2f} {rss / 2**20:>12.0f}  {'ok' if good else 'WRONG'}"
                  f"{'' if within else ' OVER'}: {answer}", flush=True)
        sample = [f for _, f in layout.rank_dirs(Path(shared))][:: max(1, ranks // 16)][:16]
        t0 = time.perf_counter()
        for folder in sample:  # what a reader without the indexes would do: every line, every snapshot
            from distdebug.artifacts.reader import read_stream
            from distdebug.fingerprint.snapshots import read_snapshots

            read_stream(folder / layout.EVENTS)
            read_snapshots(folder)
        whole = (time.perf_counter() - t0) / len(sample) * ranks
        print(f"for comparison, reading every rank's records and snapshots whole (as without the indexes): "
              f"{whole:.0f} s (16 ranks' {whole * len(sample) / ranks:.1f} s, x {ranks / len(sample):.0f})")
        print("PASS" if ok else "FAIL")
        if not ok:
            sys.exit(1)
    finally:
        if not keep and root.exists():
            shutil.rmtree(root)


if __name__ == "__main__":
    main()
