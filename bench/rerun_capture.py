"""What ``attach --rerun-on-anomaly`` costs: the capture's memory, and its time measured inside the job.

    python bench/rerun_capture.py                  # both recipes
    python bench/rerun_capture.py --only gpt       # one of: gpt, convnet

Memory (in this process, no ranks): the recipe's model trained for a few steps with a Recorder holding
the default number of steps (rerun.keep); printed: what the held captures occupy against the
parameters' own size (parameter and buffer copies per held step, each call's inputs and output
gradients).

Time: one ``distdebug attach --measure-overhead --detectors rerun --rerun-on-anomaly`` run per
recipe: only the rerun detector runs, switched off and on inside the job in pairs of blocks of steps (one
on, one off, the order drawn per pair; the same steps on every rank), so the machine's noise hits both
sides alike; printed: its overhead with the 95 % interval over the pairs (runtime.overhead), as
bench/attach_overhead.py does for the default detectors.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distdebug.analysis.overhead import describe  # noqa: E402
from distdebug.procs import run_tree  # noqa: E402

TARGETS = {"gpt": ("recipes/gpt_ddp.py", 402, 8), "convnet": ("recipes/ddp_convnet.py", 802, 16)}


def _recipe(path: str):  # noqa: ANN202 (a module)
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    assert spec is not None and spec.loader is not None
    sys.path.insert(0, str(ROOT / "recipes"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def memory(name: str) -> str:
    import torch

    from distdebug.config import RerunConfig
    from distdebug.runtime.rerun import Recorder

    torch.manual_seed(0)
    if name == "gpt":
        model = _recipe("recipes/gpt_ddp.py").GPT(512, 64, 4, 128, 4)

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            idx = torch.randint(512, (8, 65))
            return idx[:, :-1], idx[:, 1:]

        def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    else:
        model = _recipe("recipes/ddp_convnet.py").ConvNet()

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(32, 3, 32, 32), torch.randint(10, (32,))

        def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out, y)

    keep = RerunConfig().keep
    rec = Recorder(model, keep=keep)
    model.register_forward_pre_hook(rec.forward_pre, with_kwargs=True)
    model.register_forward_hook(rec.forward_post, with_kwargs=True)
    for i, p in enumerate(rec.params):
        p.register_hook(rec.param_grad(i))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, keep + 3):
        rec.step = step
        x, y = batch()
        loss(model(x), y).backward()
        rec.backward_done()
        opt.step()
        opt.zero_grad()
    own = sum(p.numel() * p.element_size() for p in rec.params) + sum(
        b.numel() * b.element_size() for b in rec.buffers)
    held = rec.capture_bytes()
    return (f"{name}: captures of the last {keep} steps hold {held / 2**20:.2f} MiB, {held / own:.2f}x the "
            f"parameters and buffers ({own / 2**20:.2f} MiB)")


def timing(name: str, work: Path) -> str:
    script, steps, block = TARGETS[name]
    run_dir = work / name
    argv = [sys.executable, str(ROOT / "cli.py"), "attach", "--measure-overhead", "--overhead-block", str(block),
            "--detectors", "rerun", "--rerun-on-anomaly", "--run-dir", str(run_dir), str(ROOT / script),
            "--steps", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    r = run_tree(argv, timeout=1200, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{name}: attach failed ({r.returncode}):\n{r.output[-3000:]}")
    rep = run_tree([sys.executable, str(ROOT / "cli.py"), "report", "--json", str(run_dir)], timeout=300, env=env)
    o = json.loads(rep.stdout).get("overhead")
    if not o:
        raise SystemExit(f"{name}: no A/B in the report (too few steps?)")
    return f"{name} ({script}), the capture alone: {describe(o)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=sorted(TARGETS), action="append")
    args = p.parse_args()
    names = args.only or list(TARGETS)
    for name in names:
        print(memory(name), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(timing(name, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
