"""Time to analyse one profiler window from 8 ranks, side by side with reading the same files.

    python bench/trace_analysis.py            # 2-rank DDP recipe window (steps 3-7), copied to 8 ranks

Records a real window with ``distdebug attach --profile-steps`` on the DDP recipe, makes 8 ranks of
it (each copy with its own rank in distributedInfo), then times ``analyze_window`` against plain
``json`` loading of the same files. Prints both and their ratio (target: the analysis in seconds).
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distdebug.analysis.traces import analyze_window  # noqa: E402
from distdebug.procs import run_tree  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        r = run_tree([sys.executable, str(ROOT / "cli.py"), "attach", "--run-dir", str(run), "--profile-steps", "3:7",
                      str(ROOT / "recipes" / "ddp_convnet.py"), "--steps", "8"], timeout=300)
        if r.returncode != 0:
            raise SystemExit(f"recording the window failed:\n{r.output[-2000:]}")
        src = sorted((run / "traces" / "steps-3-7").glob("rank-*.gz"))
        eight = Path(tmp) / "steps-3-7"
        eight.mkdir()
        for rank in range(8):
            trace = json.load(gzip.open(src[rank % len(src)], "rt"))
            trace.setdefault("distributedInfo", {})["rank"] = rank
            with gzip.open(eight / f"rank-{rank:05d}.pt.trace.json.gz", "wt") as f:
                json.dump(trace, f)
        size = sum(f.stat().st_size for f in eight.iterdir())
        t0 = time.perf_counter()
        for f in sorted(eight.iterdir()):
            json.load(gzip.open(f, "rt"))
        read = time.perf_counter() - t0
        t0 = time.perf_counter()
        w = analyze_window(eight)
        analysis = time.perf_counter() - t0
        shutil.rmtree(eight)
    print(f"8 ranks, {size / 1e6:.1f} MB gzip, {len(w['ranks'])} analysed: read {read:.2f} s, "
          f"analysis {analysis:.2f} s (read included), ratio {analysis / read:.2f}")


if __name__ == "__main__":
    main()
