"""``distdebug faults replay``: run every fault (and a clean run) under attach and check that the right
detector caught it, with the right rank, step and subject. The matrix is fault x engine.

Stages, as in the rest of distdebug: run (one ``distdebug attach --inject`` per cell, each in its own
process tree, killed on timeout) -> load (the run directory: ``injected`` records and findings)
-> verdict (``judge``: pure, tested on synthetic records) -> render (the CLI's table and JUnit XML).

A cell is
- caught: a finding of the fault's detector, not before the fault acted;
- localised: every finding the fault declares (``Fault.expect``, built from what the fault actually
  hit: rank, step, parameter, module, file) is there;
- a miss otherwise, also when the detector is not built yet;
- did-not-act when the fault said why it did not act, or that what it did was undone before its detector
  could see it (``not_acted`` records: a parameter nobody else holds, a flip the optimizer rewrote): its own
  reason, counted apart (not the detector's miss, nor a failure of the replay);
- an error when the fault was scheduled but neither acted nor said why (a defect of the fault), the run
  timed out, or its exit code was not the expected one.
A clean run per engine must have no finding at all.

On a user's script (``replay_script``) the clean run is also a probe (fault_injection.probe): what
the script has decides which faults can act on it (the others are not-applicable cells, with the
reason, skipped in JUnit) and fits each fault's step and target to it.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distdebug import envvars
from distdebug.artifacts import schema
from distdebug.config import EXIT_NEVER_ACTED

from .base import Expect, Fault
from .registry import FAULTS
from .sandbox import Isolation

REPLAY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Engine:
    """A recipe run the replay uses: script and arguments (steps are added per fault)."""

    script: str
    args: tuple[str, ...] = ()
    prepare: tuple[str, ...] | None = None
    """Arguments of a run before the faulty one (a checkpoint to resume from), or None."""
    resume: tuple[str, ...] = ()
    """Arguments of the faulty run after a prepare run."""
    steps: bool = True
    """Whether the script takes --steps (a training recipe does; the doctor's worker does not)."""
    nproc: int = 2
    """Ranks the recipe needs at least (a 2-D layout needs 4)."""
    aim: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Fault name -> spec parameters that aim it in this recipe (a pipeline's NaN is born on stage 0,
    so that the next stage receives it)."""
    parity: bool = False
    """Its cells are judged by ``distdebug parity`` (each candidate against the recipe at 1 rank and its twin,
    run once for the replay: ``parity_reference``), not by a detector's findings."""


def _script(name: str) -> Path:
    """A recipe by file name, or the doctor's worker (``doctor:``)."""
    if name.startswith("doctor:"):
        import distdebug.doctor

        return Path(distdebug.doctor.__file__).resolve().parent / name.split(":", 1)[1]
    import distdebug.recipes as recipes

    return Path(recipes.__file__).resolve().parent / name


ENGINES: dict[str, Engine] = {
    "ddp": Engine("ddp_convnet.py"),
    "manual": Engine("manual_allreduce.py"),
    "fsdp2": Engine("fsdp2_transformer.py"),
    "zero2": Engine("deepspeed_zero.py", ("--zero-stage", "2")),
    "zero2_resume": Engine("deepspeed_zero.py", ("--zero-stage", "2"),
                           prepare=("--steps", "4", "--checkpoint-at", "3"), resume=("--steps", "2", "--resume")),
    "doctor": Engine("doctor:worker.py", ("--bandwidth", "--max-bytes", "4096"), steps=False),
    "tp": Engine("tensor_parallel.py", ("--layout", "tp")),
    "ddp_tp": Engine("tensor_parallel.py", ("--layout", "ddp_tp"), nproc=4,
                     aim={"bitflip_param": {"param": "w2.weight"}}),
    "hsdp_tp": Engine("tensor_parallel.py", ("--layout", "hsdp_tp"), nproc=4,
                      aim={"bitflip_param": {"param": "w2.weight"}}),
    "pp": Engine("pipeline_parallel.py", ("--schedule", "Schedule1F1B"), aim={"nan_activation": {"rank": 0}}),
    "pp_dp": Engine("pipeline_parallel.py", ("--dp", "2"), nproc=4),
    "parity": Engine("parity_mlp.py", parity=True),
}
"""Engine name -> recipe. ``zero2_resume`` saves a checkpoint in one run and resumes it in the next;
``doctor`` is ``distdebug doctor --bandwidth``'s worker (the link matrix). The parallel layouts (issue
21): tensor parallel on 2 ranks, DDP x TP and HSDP x TP on 4 (a bit flip in a TP shard, compared with
its data-parallel replica only), a 2-stage pipeline, and 2 pipelines x 2 stages averaging by hand. ``parity``
(issue 50): a training that holds its global batch equal at any number of ranks, its faults judged by
``distdebug parity`` against the recipe at 1 rank."""


@dataclass
class Cell:
    fault: str
    engine: str
    spec: str
    status: str = "miss"
    """caught-localised | caught | miss | clean | false-alarm | error | not-applicable | did-not-act"""
    detector: str = ""
    steps_to_detection: int | None = None
    wall_s: float = 0.0
    exit_code: int | None = None
    expected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    reason: str = ""
    run_dir: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("caught-localised", "clean", "not-applicable", "did-not-act")

    @property
    def applicable(self) -> bool:
        return self.status != "not-applicable"

    @property
    def skipped(self) -> bool:
        """Nothing for the detector to catch: the fault cannot act on the script, or it said why it did not."""
        return self.status in ("not-applicable", "did-not-act")


def _matches(f: dict[str, Any], e: Expect) -> bool:
    if f.get("detector") != e.detector:
        return False
    if e.ranks is not None and sorted(f.get("ranks") or []) != sorted(e.ranks):
        return False
    if e.step is not None and f.get("step") != e.step:
        return False
    if e.subject is not None and f.get("subject") != e.subject:
        return False
    evidence = f.get("evidence") or {}
    return all(evidence.get(k) == v for k, v in e.evidence.items())


def judge(fault: Fault | None, world: int, injected: list[dict[str, Any]], findings: list[dict[str, Any]],
          cell: Cell, not_acted: list[dict[str, Any]] | None = None) -> Cell:
    """Fill in the verdict of one cell from what the run recorded (pure): ``injected`` and ``not_acted``
    records (the fault's acts, and its reasons for not acting), and the findings."""
    if fault is None:  # the clean run: a note (info: a framework default's cost, say) is no alarm
        findings = [f for f in findings if f.get("severity") != "info"]
        cell.status = "clean" if not findings else "false-alarm"
        if findings:
            cell.reason = "; ".join(f"{f.get('detector')}: {f.get('subject')} (step {f.get('step')})"
                                    for f in findings[:5])
        return cell
    cell.detector = fault.catcher
    from distdebug.analysis.summary import acted, why_not

    said = [r for r in not_acted or () if r.get("fault") == fault.name]
    undone = bool(said) and fault.name not in acted(injected, said)
    if undone and not injected:
        # The fault knows why: said in its words, neither the detector's miss nor a generic reason.
        cell.status, cell.reason = "did-not-act", "; ".join(why_not([fault.name], said).get(fault.name, []))
        return cell
    if not injected:
        # Neither acted nor said why: a fault gives its reason (Fault.not_acted, or the end-of-run fallback).
        cell.status = "error"
        cell.reason = ("the fault was scheduled but never acted, and gave no reason (a defect of the fault: every "
                       "fault says why it did not act)")
        return cell
    first = min((i["step"] for i in injected if i.get("step") is not None), default=None)
    # A finding before the fault acted is not its catch (a fault that acts at set-up, step 1, can be
    # found at any step, step 0 included: the initial parameters).
    caught = [f for f in findings if f.get("detector") == fault.catcher
              and (first is None or first <= 1 or f.get("step") is None or f["step"] >= first)]
    expects = fault.expect(world, injected)
    cell.expected = [e.describe() for e in expects]
    cell.missing = [e.describe() for e in expects if not any(_matches(f, e) for f in findings)]
    steps = [f["step"] for f in caught if isinstance(f.get("step"), int)]
    if steps and first is not None:
        cell.steps_to_detection = max(0, min(steps) - first)
    if not caught and undone:
        # It acted, and says its effect was undone before the detector could see it (a flip rewritten, a NaN
        # that never reached the loss): its reason, not the detector's miss. A catch stays a catch: the fault's
        # own check of its effect is a guess the findings overrule.
        cell.status, cell.reason = "did-not-act", "; ".join(why_not([fault.name], said).get(fault.name, []))
    elif not caught:
        cell.status = "miss"
        cell.reason = f"no finding from {fault.catcher}" + ("" if _built(fault.catcher) else " (detector not built)")
    elif cell.missing:
        cell.status, cell.reason = "caught", "not localised: missing " + "; ".join(cell.missing)
    else:
        cell.status = "caught-localised"
    return cell


def _built(detector: str) -> bool:
    from distdebug.detectors.registry import names

    return detector in names() or detector in ("hang", "link_matrix", "env_diff", "parity")  # launcher-, doctor-side


def _cli() -> list[str]:
    """This checkout's CLI (the root cli.py beside this folder and distdebug/), else the installed one, with
    this Python. Installed, the folder above this package is distdebug itself: its cli.py is the click
    module, not an entry to run as a script."""
    root = Path(__file__).resolve().parents[1]
    if (root / "cli.py").is_file() and (root / "distdebug" / "__init__.py").is_file():
        return [sys.executable, str(root / "cli.py")]
    return [sys.executable, "-m", "distdebug"]


def _steps(fault: Fault | None) -> int:
    step = int(getattr(fault, "step", 0) or 0)
    return max(fault.steps if fault is not None else 10, step + 4)


def run_cell(fault: Fault | None, engine_name: str, work: Path, nproc: int, script: list[str] | None = None,
             timeout: float = REPLAY_TIMEOUT_S, probe: bool = False, standalone: bool = False,
             isolation: Isolation | None = None, keep: bool = False,
             pair: tuple[Path, Path] | str | None = None) -> Cell:
    """Run one cell (a fault on an engine, or the clean run when fault is None) and judge it.

    ``probe``: the clean run also records what the script has (fault_injection.probe); ``standalone``:
    the run's rendezvous on a free port of its own (cells run side by side); ``isolation``: the script runs
    in a copy of the working directory of its own (fault_injection.sandbox), beside its run dir, removed
    after the run unless it failed and ``keep``; ``pair``: on a parity recipe, the reference's and its twin's run
    directories (``parity_reference``), or why there are none."""
    if isinstance(pair, str):
        name = fault.name if fault is not None else "clean"
        return Cell(fault=name, engine=engine_name, spec=fault.spec() if fault is not None else "", status="error",
                    detector="parity", reason=pair)
    if isolation is None:
        return _run_cell(fault, engine_name, work, nproc, script, timeout, probe, standalone, None, pair)
    runs = work / f"{fault.name if fault is not None else 'clean'}-{engine_name}"
    cell: Cell | None = None
    try:
        cell = _run_cell(fault, engine_name, work, nproc, script, timeout, probe, standalone, isolation, pair)
        return cell
    finally:
        if cell is None or cell.ok or not keep:
            isolation.remove_copy(runs)


def _run_cell(fault: Fault | None, engine_name: str, work: Path, nproc: int, script: list[str] | None,
              timeout: float, probe: bool, standalone: bool, isolation: Isolation | None,
              pair: tuple[Path, Path] | None = None) -> Cell:
    from distdebug.artifacts.reader import load_run
    from distdebug.procs import run_tree

    name = fault.name if fault is not None else "clean"
    cell = Cell(fault=name, engine=engine_name, spec=fault.spec() if fault is not None else "")
    runs = work / f"{name}-{engine_name}"
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop(envvars.REPLAY_BACKUP, None)
    base = [*_cli(), "attach", "--nproc-per-node", str(nproc), *(["--standalone"] if standalone else [])]
    cwd: Path | None = None
    if script is not None:
        target = list(script)
        if isolation is not None:
            try:
                cwd = isolation.copy(runs)
            except OSError as e:
                cell.status, cell.reason = "error", f"could not copy the working directory for this run: {e}"
                return cell
            target = isolation.script(target, cwd)
            if probe:
                env[envvars.REPLAY_BACKUP] = str(isolation.backups)
    else:
        engine = ENGINES[engine_name]
        target = [str(_script(engine.script)), *engine.args]
        if engine.prepare is not None:
            target += ["--checkpoint-dir", str(runs / "ckpt")]
            prep = run_tree([*base, "--run-dir", str(runs / "prepare"), *target, *engine.prepare],
                            timeout=timeout, env=env)
            if prep.returncode != 0:
                cell.status, cell.reason = "error", f"the preparing run failed ({prep.returncode})"
                return cell
            target += list(engine.resume)
        elif engine.steps:
            target += ["--steps", str(_steps(fault))]
    run_dir = runs / "run"
    cell.run_dir = str(run_dir)
    argv = [*base, "--run-dir", str(run_dir), *(["--parity", "record"] if pair is not None else [])]
    if fault is not None:
        rerun = ["--rerun-on-anomaly"] if engine_name in getattr(fault, "rerun_on", ()) else []
        argv += [*fault.attach_args, *rerun, "--inject", fault.spec()]
    elif probe:
        argv += ["--inject", "probe"]
    t0 = time.monotonic()
    r = run_tree([*argv, *target], timeout=timeout, env=env, cwd=cwd)
    cell.wall_s = time.monotonic() - t0
    cell.exit_code = r.returncode
    if r.timed_out:
        cell.status, cell.reason = "error", f"timed out after {timeout:.0f} s (--cell-timeout)"
        return cell
    if not run_dir.is_dir():
        cell.status, cell.reason = "error", f"attach failed ({r.returncode}): {r.stderr.strip()[-300:]}"
        return cell
    run = load_run(run_dir)
    findings = run.all_findings()
    injected = [rec for s in run.ranks.values() for rec in s.last_attempt() if rec.get("kind") == schema.INJECTED]
    not_acted = [rec for s in run.ranks.values() for rec in s.last_attempt() if rec.get("kind") == schema.NOT_ACTED]
    # Setup-time faults act on every rank the same way: judged once per rank that acted.
    if pair is not None:
        judge_parity(fault, pair, run_dir, injected, cell, not_acted)
    else:
        judge(fault, world=nproc, injected=injected, findings=findings, cell=cell, not_acted=not_acted)
    said = fault is not None and any(rec.get("fault") == fault.name for rec in not_acted)
    return judge_exit(fault, r.returncode, bool(injected), cell, said=said)


def judge_parity(fault: Fault | None, pair: tuple[Path, Path], run_dir: Path, injected: list[dict[str, Any]],
                 cell: Cell, not_acted: list[dict[str, Any]] | None = None) -> Cell:
    """The verdict of a cell on a parity recipe: ``distdebug parity`` of its run (the candidate) against the
    reference and its twin (``pair``). The clean candidate must be equivalent; a fault's must depart at the step
    it acted in, at the quantity it names first (``Fault.parity_expect``), with its class as the likely cause."""
    from distdebug.analysis import parity as pm
    from distdebug.analysis.summary import acted, why_not
    from distdebug.artifacts.reader import load_run

    cell.detector = "parity"
    try:
        ref, twin, cand = (pm.recorded(load_run(p)) for p in (*pair, run_dir))
        result = pm.compare_runs(ref, twin, cand)
    except Exception as e:  # noqa: BLE001 (one cell's error, said; the replay's other cells go on)
        why = str(e) if isinstance(e, pm.CannotCompare) else f"{type(e).__name__}: {e}"
        cell.status, cell.reason = "error", f"parity cannot compare: {why}"
        return cell
    v = result.verdict
    if fault is None:
        cell.status = "clean" if v.equivalent else "false-alarm"
        cell.reason = "" if v.equivalent else result.text().replace("\n", "; ")
        return cell
    said = [r for r in not_acted or () if r.get("fault") == fault.name]
    expect = fault.parity_expect(injected)
    if expect is None:
        if said and fault.name not in acted(injected, said):
            cell.status, cell.reason = "did-not-act", "; ".join(why_not([fault.name], said).get(fault.name, []))
        else:
            cell.status, cell.reason = "error", "the fault never acted, and gave no reason"
        return cell
    quantity = {"grad": f"grad:{ref.names[0]}", "param": f"param:{ref.names[0]}"}.get(expect.quantity,
                                                                                     expect.quantity)
    cell.expected = [f"parity departs at step {expect.step} at {quantity}, likely cause {expect.cause}"]
    if v.first is None:
        cell.status, cell.reason = "miss", f"parity: {v.text()}"
        return cell
    cell.steps_to_detection = max(0, v.first.step - expect.step)
    kinds = [c.kind for c in result.causes]
    said_here = (f"departs at step {v.first.step} at {v.first.quantity}, likely cause "
                 f"{kinds[0] if kinds else 'none named'}")
    if (v.first.step, v.first.quantity, kinds[:1]) == (expect.step, quantity, [expect.cause]):
        cell.status = "caught-localised"
    else:
        cell.status, cell.missing = "caught", list(cell.expected)
        early = " (before the fault acted: the pair departs without it)" if v.first.step < expect.step else ""
        cell.reason = f"not localised: parity says {said_here}{early}; expected {cell.expected[0]}"
    return cell


def parity_reference(engine_name: str, work: Path, fault_steps: int, timeout: float = REPLAY_TIMEOUT_S,
                     standalone: bool = False) -> tuple[Path, Path] | str:
    """The reference of a parity recipe's cells, run once for the replay: the recipe at 1 rank with ``--parity
    record``, and again as its twin (``--parity twin``), for ``fault_steps`` steps (no candidate runs fewer).
    Under ``--jobs`` above 1 (``standalone``: each run on its own rendezvous port) the two run side by side: the
    replay judges their numbers, not their times. Returns their run directories, or why they could not be made
    (every cell on the recipe is then an error)."""
    from concurrent.futures import ThreadPoolExecutor

    from distdebug.procs import run_tree

    engine = ENGINES[engine_name]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop(envvars.REPLAY_BACKUP, None)
    runs = {mode: work / f"parity-{engine_name}" / ("ref" if mode == "record" else "twin")
            for mode in ("record", "twin")}

    def launch(mode: str) -> str | None:
        run = runs[mode]
        shutil.rmtree(run, ignore_errors=True)
        r = run_tree([*_cli(), "attach", "--nproc-per-node", "1", *(["--standalone"] if standalone else []),
                      "--run-dir", str(run), "--parity", mode, str(_script(engine.script)), *engine.args,
                      "--steps", str(fault_steps)], timeout=timeout, env=env)
        if r.returncode != 0 or r.timed_out:
            return (f"the parity reference ({'its twin' if mode == 'twin' else 'the recipe at 1 rank'}) failed "
                    f"({'timed out' if r.timed_out else f'exit code {r.returncode}'}): {r.stderr.strip()[-300:]}")
        return None

    if standalone:
        with ThreadPoolExecutor(2) as pool:
            whys = list(pool.map(launch, runs))
    else:  # one after the other: a failed reference needs no twin
        whys = [launch("record")]
        if whys[0] is None:
            whys.append(launch("twin"))
    failed = [why for why in whys if why is not None]
    return failed[0] if failed else (runs["record"], runs["twin"])


def judge_exit(fault: Fault | None, code: int, acted: bool, cell: Cell, said: bool = False) -> Cell:
    """The verdict once attach's exit code is known (pure): an unexpected code is an error, said as the
    fault-injection's error when the fault broke the training; attach's never-acted code keeps judge()'s
    reason."""
    expected_exits = fault.exit_codes if fault is not None else (0,)
    if code == EXIT_NEVER_ACTED and fault is not None and (not acted or said):
        return cell  # attach's own word for it: judge() gave the never-acted reason, the fault's own, or its catch
    if code not in expected_exits:
        if cell.ok or fault is None:
            cell.status, cell.reason = "error", f"exit code {code}, expected {list(expected_exits)}"
        else:  # the fault broke the script (a framework that rejects what it did): not a detector's miss
            cell.status, cell.reason = "error", (
                f"the training failed under the fault (exit code {code}, expected {list(expected_exits)}): "
                "a fault-injection error, not a detector's miss")
    return cell


def plan(faults: list[str] | None, engines: list[str] | None) -> list[tuple[str, str]]:
    """(fault or 'clean', engine) cells on the recipes, in run order: each engine's clean run first."""
    chosen = faults or list(FAULTS)
    cells: list[tuple[str, str]] = []
    used: list[str] = []
    for f in chosen:
        for e in FAULTS[f].engines:
            if engines and e not in engines:
                continue
            cells.append((f, e))
            if e not in used:
                used.append(e)
    return [("clean", e) for e in used if ENGINES[e].prepare is None] + cells


def _run_all(jobs: list[Callable[[], Cell]], parallel: int, on_cell: Callable[[Cell], None] | None) -> list[Cell]:
    """Run the cells, ``parallel`` at a time (each is its own process tree); results in the given order."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    def done(cell: Cell) -> Cell:
        if on_cell is not None:
            on_cell(cell)
        return cell

    if parallel <= 1 or len(jobs) <= 1:
        return [done(job()) for job in jobs]
    with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="distdebug-replay") as pool:
        futures = {pool.submit(job): i for i, job in enumerate(jobs)}
        out: list[Cell | None] = [None] * len(jobs)
        for fut in as_completed(futures):
            out[futures[fut]] = done(fut.result())
    return [c for c in out if c is not None]


def _prune(cells: list[Cell], keep: bool) -> None:
    """Remove the run directories of the cells that passed (kept: the failed ones and those whose fault did
    not act, to look into why)."""
    if keep:
        return
    for c in cells:
        if c.ok and c.status != "did-not-act" and c.run_dir:
            shutil.rmtree(Path(c.run_dir).parent, ignore_errors=True)
            c.run_dir = ""


def replay(cells: list[tuple[str, str]], work: Path, nproc: int = 2, on_cell: Callable[[Cell], None] | None = None,
           jobs: int = 1, timeout: float = REPLAY_TIMEOUT_S, keep: bool = True) -> list[Cell]:
    """Replay faults on the project's recipes (``plan``'s cells)."""
    todo: list[Callable[[], Cell]] = []
    pairs: dict[str, tuple[Path, Path] | str] = {}
    for engine in dict.fromkeys(e for _, e in cells if ENGINES[e].parity):  # the reference first, once a recipe
        made = [FAULTS[f](**ENGINES[engine].aim.get(f, {})) for f, e in cells if e == engine and f != "clean"]
        pairs[engine] = parity_reference(engine, work, min([_steps(None), *map(_steps, made)]), timeout,
                                         standalone=jobs > 1)
    for fault_name, engine in cells:
        recipe = ENGINES[engine]
        fault = FAULTS[fault_name](**recipe.aim.get(fault_name, {})) if fault_name != "clean" else None
        # A fault that needs more ranks (a slow pair among others) gets them, and so does a recipe.
        world = max(nproc, fault.min_world if fault is not None else 1, recipe.nproc)
        todo.append(functools.partial(run_cell, fault, engine, work, world, timeout=timeout, standalone=jobs > 1,
                                      pair=pairs.get(engine)))
    out = _run_all(todo, jobs, on_cell)
    _prune(out, keep)
    for engine in pairs:  # the reference and its twin go with the last cell that needed them
        if not keep and all(c.ok for c in out if c.engine == engine):
            shutil.rmtree(work / f"parity-{engine}", ignore_errors=True)
    return out


def replay_script(script: list[str], faults: list[str], work: Path, nproc: int = 2,
                  overrides: dict[str, dict[str, Any]] | None = None, jobs: int = 1,
                  timeout: float = REPLAY_TIMEOUT_S, keep: bool = False,
                  on_cell: Callable[[Cell], None] | None = None,
                  on_plan: Callable[[int], None] | None = None,
                  on_isolation: Callable[[Isolation], None] | None = None) -> list[Cell]:
    """Replay faults on a user's script: a clean probe run first (it is the clean cell too), then each
    fault the probe shows can act on the script, fitted to it (``Fault.fit``: its step from the number
    of steps, its target from the model; ``overrides``: the user's parameters per fault, which win);
    the others are not-applicable cells with the reason. ``on_plan`` gets the number of runs to come.

    Each run starts from a copy of the working directory as it was before the replay, and the paths outside
    it the clean run saved to are put back after every run (fault_injection.sandbox: a script that resumes
    from its own checkpoint would resume every later run from an earlier one's); such runs go one at a time,
    as they share those paths. ``on_isolation`` gets what was isolated, after the last run."""
    work = Path(os.path.abspath(work))  # the runs start in copies elsewhere: their run dirs are given absolute
    isolation = Isolation(Path.cwd(), work)
    try:
        return _replay_script(script, faults, work, nproc, overrides, jobs, timeout, keep, on_cell, on_plan,
                              isolation)
    finally:
        isolation.restore()
        isolation.close()
        if on_isolation is not None:
            on_isolation(isolation)


def _replay_script(script: list[str], faults: list[str], work: Path, nproc: int,
                   overrides: dict[str, dict[str, Any]] | None, jobs: int, timeout: float, keep: bool,
                   on_cell: Callable[[Cell], None] | None, on_plan: Callable[[int], None] | None,
                   isolation: Isolation) -> list[Cell]:
    from distdebug.artifacts.reader import load_run

    from .facts import Facts

    clean = run_cell(None, "script", work, nproc, script=script, timeout=timeout, probe=True, standalone=jobs > 1,
                     isolation=isolation, keep=keep)
    isolation.restore()  # before the watch: a linked file the clean run saved to, put back, is no change
    isolation.watch("clean")
    # Runs side by side would race on the paths outside (each put back between runs) or on a user's file the
    # clean run wrote through a link: one at a time then, and said.
    if (isolation.saved or isolation.changed) and jobs > 1:
        isolation.serial_from, jobs = jobs, 1
    if on_cell is not None:
        on_cell(clean)
    if clean.status == "error" or clean.exit_code != 0:
        what = clean.reason if clean.status == "error" else f"exit code {clean.exit_code}"
        clean.status = "error"
        clean.reason = (f"the clean run of the script failed ({what}): the replay needs a script that runs to "
                        "its end without faults")
        return [clean]
    facts = Facts.load(load_run(Path(clean.run_dir)))
    cells: list[Cell | None] = [clean]  # None: a run to come, in this order
    todo: list[Callable[[], Cell]] = []
    for name in faults:
        cls = FAULTS[name]
        reason = cls.applicable(facts)
        if reason:
            cells.append(Cell(fault=name, engine="script", spec="", status="not-applicable", detector=cls.catcher,
                              reason=reason))
            continue
        cells.append(None)
        fault = cls(**{**cls.fit(facts), **(overrides or {}).get(name, {})})
        world = max(nproc, fault.min_world)
        todo.append(_isolated(functools.partial(run_cell, fault, "script", work, world, script=script,
                                                timeout=timeout, standalone=jobs > 1, isolation=isolation,
                                                keep=keep), name, isolation))
    if on_plan is not None:
        on_plan(len(todo))
    ran = iter(_run_all(todo, jobs, on_cell))
    out = [c if c is not None else next(ran) for c in cells]
    _prune(out, keep)
    return out


def _isolated(job: Callable[[], Cell], name: str, isolation: Isolation) -> Callable[[], Cell]:
    """The run, then the paths outside the copy put back (runs that have any go one at a time) and the user's
    linked files checked."""
    def run() -> Cell:
        try:
            return job()
        finally:
            isolation.restore()
            isolation.watch(name)

    return run


def junit_xml(cells: list[Cell]) -> str:
    """JUnit XML in pytest's shape (``testsuites`` > ``testsuite`` > ``testcase``, the attributes pytest
    writes), which CI viewers read: one test case per cell; a miss, false alarm or error is a failure,
    a fault that cannot act on the script is skipped (with the reason)."""
    import socket
    from datetime import datetime, timezone
    from xml.etree import ElementTree as ET

    root = ET.Element("testsuites", name="distdebug faults replay")
    suite = ET.SubElement(root, "testsuite", name="distdebug-faults", errors="0",
                          failures=str(sum(not c.ok for c in cells)),
                          skipped=str(sum(c.skipped for c in cells)), tests=str(len(cells)),
                          time=f"{sum(c.wall_s for c in cells):.3f}",
                          timestamp=datetime.now(timezone.utc).isoformat(), hostname=socket.gethostname())
    for c in cells:
        case = ET.SubElement(suite, "testcase", classname=f"faults.{c.engine}", name=c.fault,
                             time=f"{c.wall_s:.3f}")
        if c.skipped:
            kind = "not applicable" if not c.applicable else "did not act"
            skip = ET.SubElement(case, "skipped", type=f"distdebug.{kind.replace(' ', '_')}",
                                 message=f"{kind}: {c.reason}"[:500])
            skip.text = c.reason
        elif not c.ok:
            fail = ET.SubElement(case, "failure", message=f"{c.status}: {c.reason}"[:500])
            fail.text = "\n".join([f"spec: {c.spec}", f"expected: {c.expected}", f"missing: {c.missing}",
                                   f"run dir: {c.run_dir}"])
        else:
            ET.SubElement(case, "system-out").text = (
                f"{c.status}; spec {c.spec or '-'}; steps to detection {c.steps_to_detection}; "
                f"run dir {c.run_dir or '(removed: passed)'}" + (f"; expected {'; '.join(c.expected)}"
                                                                 if c.expected else ""))
    return '<?xml version="1.0" encoding="utf-8"?>' + ET.tostring(root, encoding="unicode")
