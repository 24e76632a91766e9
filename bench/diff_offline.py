"""Offline ``distdebug diff`` of a simulated run: 4096 ranks x 2000 tensors (target: under 2 s).

    python bench/diff_offline.py                     # 4096 ranks, 2000 tensors, 4 steps, one corrupt tensor
    python bench/diff_offline.py --ranks 1024 --tensors 500

Writes the run directory with the real snapshot writer (set-up, not timed), then times what
``distdebug diff RUN`` does: load every rank's snapshots and find the first divergent step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from distdebug.analysis.diff import first_divergent_step, load_snapshots  # noqa: E402
from distdebug.artifacts import layout  # noqa: E402
from distdebug.fingerprint.snapshots import SnapshotWriter  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--tensors", type=int, default=2000)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    names = [f"layers.{i // 8}.{['wq', 'wk', 'wv', 'wo', 'w1', 'w2', 'norm1', 'norm2'][i % 8]}.weight"
             for i in range(args.tensors)]
    base = {s: rng.integers(0, 2**63, size=args.tensors, dtype=np.uint64) for s in range(1, args.steps + 1)}
    bad_rank, bad_step, bad_tensor = args.ranks // 3, args.steps - 1, args.tensors // 2
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        t0 = time.perf_counter()
        for r in range(args.ranks):
            w = SnapshotWriter(layout.rank_dir(run, r))
            for s in range(1, args.steps + 1):
                values = base[s].copy()
                if r == bad_rank and s >= bad_step:
                    values[bad_tensor] ^= np.uint64(1 << 7)
                w.write(s, dict(zip(names, values.tolist(), strict=True)))
            w.close()
        setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        snaps = load_snapshots(run)
        step, diffs = first_divergent_step(snaps)
        took = time.perf_counter() - t0
    assert step == bad_step and [d.tensor for d in diffs] == [names[bad_tensor]] and diffs[0].ranks == [bad_rank]
    print(f"{args.ranks} ranks x {args.tensors} tensors x {args.steps} steps (set-up {setup:.1f} s): "
          f"first divergent step {step}, tensor {diffs[0].tensor}, rank {diffs[0].ranks} "
          f"found in {took:.2f} s (target < 2 s)")


if __name__ == "__main__":
    main()
