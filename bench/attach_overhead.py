"""Step-time overhead of ``distdebug attach`` (default detectors) against bare ``torchrun``, side by side.

    python bench/attach_overhead.py                      # ddp_convnet, 6 rounds of 60 steps
    python bench/attach_overhead.py --batch-size 128     # a heavier step (unknown options go to the recipe)
    python bench/attach_overhead.py --recipe fsdp2_transformer --rounds 5 --steps 100
    python bench/attach_overhead.py --attach-args "--fingerprint-every 10"

Bare and attached runs alternate round by round, so machine noise hits both alike. Each run's
recipe reports its own median step time (process start-up excluded); the result is the ratio of
the medians over all rounds and ranks. Prints one line per round and a final ``ratio`` line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distdebug.procs import run_tree  # noqa: E402


def median_step_s(out_dir: Path) -> list[float]:
    return [float(p.read_text().split()[2]) for p in sorted(out_dir.glob("rank*.txt"))]


def one(kind: str, recipe: str, steps: int, work: Path, extra: list[str], attach_args: list[str]) -> list[float]:
    out = work / kind
    script = str(ROOT / "recipes" / f"{recipe}.py")
    args = [script, "--steps", str(steps), "--digest-out", str(out), *extra]
    if kind == "bare":
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args]
    else:
        argv = [sys.executable, str(ROOT / "cli.py"), "attach", "--run-dir", str(work / "run"), *attach_args, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    r = run_tree(argv, timeout=600, env=env, cwd=ROOT)
    times = median_step_s(out) if out.exists() else []
    if r.returncode != 0:
        if len(times) == 2:
            # Every rank finished its steps and wrote its timing; the failure came at the exit (gloo
            # sometimes aborts in process-group teardown, bare torchrun too). The timing stands.
            print(f"  ({kind} run exited {r.returncode} after finishing its steps; its timing is kept)")
            return times
        raise SystemExit(f"{kind} run failed ({r.returncode}):\n{r.output[-3000:]}")
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="ddp_convnet")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--attach-args", default="", help="options for attach, e.g. '--fingerprint-every 10'")
    args, extra = p.parse_known_args()
    times: dict[str, list[float]] = {"bare": [], "attach": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for kind in (("bare", "attach") if i % 2 == 0 else ("attach", "bare")):
                t = one(kind, args.recipe, args.steps, Path(tmp) / f"{i}", extra, args.attach_args.split())
                times[kind] += t
                print(f"round {i + 1} {kind:6s} median step {[f'{x * 1000:.2f} ms' for x in t]}", flush=True)
    bare, att = statistics.median(times["bare"]), statistics.median(times["attach"])
    # The noise floor: how far apart two bare runs of the same command land on this machine. A ratio
    # within it says "no overhead measurable here", not a number to trust to the percent.
    spread = max(times["bare"]) / min(times["bare"])
    print(f"recipe {args.recipe}: bare {bare * 1000:.3f} ms, attach {att * 1000:.3f} ms, ratio {att / bare:.3f} "
          f"(bare runs alone spread {spread:.2f}x: the noise floor)")


if __name__ == "__main__":
    main()
