"""What ``distdebug attach`` costs a job, measured inside the job (issue 18): the three targets.

    python bench/attach_overhead.py                 # all three targets
    python bench/attach_overhead.py --only gpt      # one of: gpt, convnet, fixed
    python bench/attach_overhead.py --attach-args "--fingerprint-every 10"

Each target is one ``distdebug attach --measure-overhead`` run: the detectors are switched off and on
in alternating blocks of steps inside the same job (the same steps on every rank), so the machine's
noise hits both sides alike; two whole runs on this shared machine land up to 40% apart, neighbouring
blocks do not. Every default detector runs, fingerprints every step. Printed per target: the overhead
(a fraction of the step time without the detectors) with its 95% interval over on/off block pairs,
the per-step cost, the median and 95th-percentile comparisons, and whether the target is met:

- gpt      recipes/gpt_ddp.py (about 60 ms a step on 2 ranks here): overhead <= 3%, interval's upper
           bound <= 5%;
- convnet  recipes/ddp_convnet.py (a 3-7 ms step): overhead <= 10%;
- fixed    bench/hundred_modules.py (100 modules, almost no compute): per-step cost <= 0.25 ms.

What the detectors cost is in each run's own accounting too (``harness cost per step``), printed after
the A/B: which detector takes the time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distdebug.analysis.overhead import describe  # noqa: E402
from distdebug.procs import run_tree  # noqa: E402

TARGETS = {
    # name: (script, script args, steps, block, check(overhead) -> (met, what))
    "gpt": ("recipes/gpt_ddp.py", [], 402, 8,
            lambda o: (o["fraction"] <= 0.03 and o["ci"][1] <= 0.05, "overhead <= 3%, upper bound <= 5%")),
    "convnet": ("recipes/ddp_convnet.py", [], 1602, 16, lambda o: (o["fraction"] <= 0.10, "overhead <= 10%")),
    "fixed": ("bench/hundred_modules.py", [], 1602, 16,
              lambda o: (o["per_step_ms"] <= 0.25, "per-step cost <= 0.25 ms for 100 modules")),
}


def run(name: str, work: Path, attach_args: list[str]) -> bool:
    script, args, steps, block, check = TARGETS[name]
    run_dir = work / name
    argv = [sys.executable, str(ROOT / "cli.py"), "attach", "--measure-overhead", "--overhead-block", str(block),
            "--run-dir", str(run_dir), *attach_args, str(ROOT / script), *args, "--steps", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    r = run_tree(argv, timeout=1200, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{name}: attach failed ({r.returncode}):\n{r.output[-3000:]}")
    rep = run_tree([sys.executable, str(ROOT / "cli.py"), "report", "--json", str(run_dir)], timeout=300, env=env)
    data = json.loads(rep.stdout)
    o = data.get("overhead")
    if not o:
        raise SystemExit(f"{name}: no A/B in the report (too few steps?)")
    met, what = check(o)
    print(f"{name} ({script}): {describe(o)}")
    print(f"  target {what}: {'met' if met else 'NOT met'}")
    cost = data.get("harness_cost") or {}
    rank = (cost.get("ranks") or {}).get(str(cost.get("rank")))
    if rank:
        top = ", ".join(f"{k} {v:.3f}" for k, v in list(rank["per_step_ms"].items())[:5])
        print(f"  harness cost per step (rank {cost['rank']}, its own accounting): {rank['total_per_step_ms']:.3f} ms "
              f"of {rank['median_step_ms']:.2f} ms ({top})", flush=True)
    return met


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=sorted(TARGETS), action="append")
    p.add_argument("--attach-args", default="", help="more options for attach, e.g. '--fingerprint-every 10'")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        met = [run(name, Path(tmp), args.attach_args.split()) for name in (args.only or list(TARGETS))]
    print(f"{sum(met)} of {len(met)} targets met")


if __name__ == "__main__":
    main()
