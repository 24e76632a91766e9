"""Configuration dataclasses: defaults in one place, validated in ``__post_init__``.

Validation raises UserError with one line that says what is wrong and what to do, because these
values come straight from the command line. Each configurable detector's options are a dataclass
here (torch-free, so the CLI takes its defaults from them without importing torch); the detector
names it as its ``Config`` and is built with an instance of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distdebug.errors import UserError

NPROC_WORDS = ("gpu", "cpu", "auto", "xpu")

EXIT_HANG = 124
"""attach's exit code when it ended a hung job (as timeout(1) does); other failures pass through."""
EXIT_NAN = 123
"""Exit code of a job stopped at its first NaN/Inf (``--stop-on-nan``)."""
EXIT_NEVER_ACTED = 122
"""attach's exit code when the training exited 0 but a fault injected on purpose (``--inject``) never
acted: the run tested nothing, and a script or CI that checks "the detector caught it" must not read
the clean run as a pass. Only under ``--inject``; a failing training's own code always wins."""

EXIT_FINDINGS = 121
"""``report --fail-on LEVEL`` and ``attach --fail-on LEVEL``: a finding at or above LEVEL is there (for attach,
the training exited 0: a failing training's own code always wins), so a CI job gates on what was found."""
FAIL_ON = ("warning", "error", "critical")
"""The severities ``--fail-on`` takes (info never fails a run: it reports, it does not accuse)."""

STARTUP_FLOOR_S = 600.0
"""The least start-up allowance by default (``--startup-timeout``): a rank's first step may follow
minutes of imports, model building, init_process_group, the first collectives' connections and
torch.compile's first graphs; NCCL's own default for a collective is 10 minutes."""

RUN_DIR_BUDGET = 256 << 20
"""Bytes of the run directory each rank may fill by default (``--run-dir-budget``), however long the job:
a 30-day job of a 1,000-tensor model at 2 s a step (1.3 M steps, 10 GB a rank kept whole) stays within it,
its first and last thousands of steps and every finding's neighbourhood at full resolution
(artifacts.retention)."""
RUN_DIR_BUDGET_MIN = 512 << 10
"""The smallest budget: below it the held-back reserve and the first steps leave no room for a ring."""

EXPECTED_HOURS = 24.0
"""Hours a job is expected to run when neither ``--expected-hours`` nor Slurm's end time says: the log-volume
guard warns when a file system the job writes to fills before then (launch.volume)."""
VOLUME_WINDOW_S = 60.0
"""Seconds over which the log-volume guard measures what the job writes, after every local rank's second
step (start-up's one-off lines apart); ``DISTDEBUG_VOLUME_WINDOW_S`` shortens it (tests, short jobs)."""
VOLUME_RECHECK_S = 600.0
"""Seconds between the log-volume guard's later looks (a rate that rises later in the job)."""

OVERHEAD_AUTO = -1
"""``measure_overhead``'s default unit, decided in each rank: 4 steps, or 8 when the job can use CUDA
(runtime.overhead.default_unit)."""

ON_HANG = ("abort", "report")
ON_STALL = ("warn", "abort")


@dataclass(kw_only=True)
class AttachConfig:
    """Everything ``distdebug attach`` needs. Launcher fields mirror torchrun's options."""

    target: str
    """Script path, or module name when ``module`` is true."""
    target_args: list[str] = field(default_factory=list)
    """Arguments handed to the script unchanged."""
    module: bool = False
    """Run ``target`` as a module (``-m``), like ``python -m``."""
    nproc_per_node: str | None = None
    """Ranks on this node: a number, or gpu/cpu/auto/xpu. None: one per GPU with CUDA, else 2 (torchrun's
    default is 1; a debugger of cross-rank faults needs two ranks to compare)."""
    nnodes: str = "1"
    """Number of nodes, ``N`` or elastic ``MIN:MAX``."""
    node_rank: int = 0
    """This node's rank (static rendezvous only; c10d assigns ranks in joining order)."""
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: str = ""
    """torchrun's ``key=value,...`` rendezvous options, e.g. ``join_timeout=60``."""
    standalone: bool = False
    max_restarts: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    torchrun_args: list[str] = field(default_factory=list)
    """torchrun's other options as typed, handed to torch's launcher unchanged (launch.torchrun_options),
    e.g. ``["--log-dir", "logs", "--tee", "3"]``."""
    run_dir: Path | None = None
    """None: a new directory under ./distdebug-runs/."""
    detectors: list[str] | None = None
    """Detector specs; None: the registry's defaults."""
    stall_timeout: float = 300.0
    """Seconds without progress on a rank (no step, no collective finished) before it counts as
    stalled and dumps its stacks and Flight Recorder buffer; 0 turns hang detection off."""
    startup_timeout: float | None = None
    """Seconds without progress allowed to a rank that has not finished its first step yet (start-up:
    imports, model building, init_process_group, the first collectives, torch.compile), and to a
    rendezvous; None: ``max(stall_timeout, STARTUP_FLOOR_S)``. Ranks start unevenly, and one still
    building its model while another waits in the first collective is a slow start, not a hang: a job
    is never ended for it before this allowance is spent (``startup_allowance``)."""
    on_hang: str = "abort"
    """``abort``: end the job with EXIT_HANG after the verdict; ``report``: report and keep waiting."""
    on_stall: str = "warn"
    """A stall with no culprit (every rank busy in its own work, no rank waiting for another): ``warn``
    (with every rank's stack, at most once per stall timeout; the job goes on) or ``abort`` (a hang)."""
    deterministic: bool = False
    """Seed every generator (0) and turn on torch.use_deterministic_algorithms before the script."""
    detector_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per detector (its name, spec or plugin class name), options from ``--detector-option`` (strings
    or typed values); typed and checked against the detector's config dataclass by
    ``detectors.registry.resolve``. An option for a detector not in the run is an error."""
    shorthand_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The same, from attach's own options (SHORTHANDS: ``--spike-threshold``...): they apply only when
    their detector runs."""
    inject: list[dict] = field(default_factory=list)
    """Faults to run in every rank, resolved from ``--inject`` specs by fault_injection:
    ``{"target": "module:Class", "params": {...}}`` each."""
    flight_recorder_entries: int = 2000
    """TORCH_FR_BUFFER_SIZE given to ranks (when the environment does not set it); 0 leaves it off."""
    launcher_log_level: str = "CRITICAL"
    """Level for torch's elastic launcher logs: their failure lines repeat what distdebug reports."""
    replica_groups: str | None = None
    """``0,2;1,3``: the data-parallel groups (ranks holding replicas of the same part of the model), for a
    layout the harness cannot infer; overrides what discovery found (runtime.layout)."""
    rerun_on_anomaly: bool = False
    """Capture every step so that a rank flagged at a step re-executes it (detectors.rerun): reproducible or
    a transient fault. Adds the ``rerun`` detector to the run's detectors."""
    parity: str | None = None
    """``--parity record|twin``: add the parity recorder (detectors.parity), as the reference's twin or not."""
    parity_steps: str | None = None
    """``--parity-steps``: the steps the parity recorder records its tensors at (ParityConfig.steps)."""
    run_dir_budget: int = RUN_DIR_BUDGET
    """Bytes of the run directory per rank (events and fingerprints kept in tiers: artifacts.retention);
    0: unbounded, every record kept whole."""
    expected_hours: float | None = None
    """How long the job is expected to run, for the log-volume guard (launch.volume); None: Slurm's end time for
    the job where Slurm gives one, else ``EXPECTED_HOURS``."""
    measure_overhead: int = 0
    """Steps per unit of the in-job A/B (runtime.overhead): the detectors are switched off and on in pairs of
    units of this many steps (one on, one off, the order drawn per pair), the same steps on every rank; 0: off;
    ``OVERHEAD_AUTO``: 4, or 8 where CUDA is available (runtime.overhead's ``CPU_UNIT``, ``CUDA_UNIT``)."""

    def __post_init__(self) -> None:
        if self.run_dir_budget and self.run_dir_budget < RUN_DIR_BUDGET_MIN:
            raise UserError(f"--run-dir-budget {self.run_dir_budget} B is too small: give 512K or more (or 0 for "
                            "no budget)", 2)
        if self.expected_hours is not None and not self.expected_hours > 0:
            raise UserError(f"--expected-hours {self.expected_hours}: give the job's expected length in hours "
                            "(more than 0)", 2)
        if self.measure_overhead < 0 and self.measure_overhead != OVERHEAD_AUTO:
            raise UserError(f"--overhead-block {self.measure_overhead}: give 1 step or more per unit", 2)
        if self.replica_groups is not None:
            parse_replica_groups(self.replica_groups)  # a UserError now, before any rank starts
        if not self.target:
            raise UserError("no script given: distdebug attach [OPTIONS] SCRIPT [ARGS]...", 2)
        if self.nproc_per_node is not None:
            n = self.nproc_per_node
            if n not in NPROC_WORDS and not (n.isdigit() and int(n) > 0):
                raise UserError(f"--nproc-per-node must be a positive number or one of {', '.join(NPROC_WORDS)}; "
                                f"got '{n}'", 2)
        min_n, max_n = parse_nnodes(self.nnodes)
        if not 0 <= self.node_rank < max_n:
            raise UserError(f"--node-rank {self.node_rank} is outside 0..{max_n - 1} for --nnodes {self.nnodes}", 2)
        if self.max_restarts < 0:
            raise UserError("--max-restarts must be 0 or more", 2)
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UserError(f"--master-port must be 1..65535, got {self.master_port}", 2)
        if self.rdzv_backend not in ("static", "c10d", "etcd", "etcd-v2"):
            raise UserError(f"--rdzv-backend must be static or c10d (or etcd), got '{self.rdzv_backend}'", 2)
        if self.rdzv_endpoint and ":" not in self.rdzv_endpoint:
            raise UserError(f"--rdzv-endpoint must be HOST:PORT, got '{self.rdzv_endpoint}'", 2)
        if self.stall_timeout < 0:
            raise UserError(f"--stall-timeout must be 0 (off) or a number of seconds, got {self.stall_timeout}", 2)
        if self.startup_timeout is not None and self.startup_timeout <= 0:
            raise UserError(f"--startup-timeout must be a positive number of seconds, got {self.startup_timeout}", 2)
        if self.on_stall not in ON_STALL:
            raise UserError(f"--on-stall must be one of {', '.join(ON_STALL)}, got '{self.on_stall}'", 2)
        if self.on_hang not in ON_HANG:
            raise UserError(f"--on-hang must be one of {', '.join(ON_HANG)}, got '{self.on_hang}'", 2)
        if max_n > 1 and self.standalone:
            raise UserError("--standalone is for one node; drop it or use --nnodes 1", 2)
        if max_n > 1 and not self.rdzv_endpoint and self.master_addr is None:
            raise UserError(
                f"--nnodes {self.nnodes} needs a meeting point: give --rdzv-endpoint HOST:PORT "
                "(with --rdzv-backend c10d) or --master-addr/--master-port", 2)
        # Last: a malformed option is named before the script is looked for (both are the user's to fix,
        # and the option is the one a retyped command keeps getting wrong).
        if not self.module and not Path(self.target).is_file():
            raise UserError(f"script not found: {self.target} (give a path to a .py file, or -m MODULE)", 2)

    @property
    def startup_allowance(self) -> float:
        """The seconds a rank may go without progress before its first step (see ``startup_timeout``)."""
        if self.startup_timeout is not None:
            return self.startup_timeout
        return startup_allowance(self.stall_timeout)


def startup_allowance(stall_timeout: float) -> float:
    """The default start-up allowance for a stall timeout: never shorter than the stall timeout itself."""
    return max(stall_timeout, STARTUP_FLOOR_S)


def parse_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        nums = []
    if len(nums) == 1:
        nums = nums * 2
    if len(nums) != 2 or not 0 < nums[0] <= nums[1]:
        raise UserError(f"--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got '{value}'", 2)
    return nums[0], nums[1]


# ------------------------------------------------------------------ detectors' options
@dataclass(kw_only=True)
class LossSpikeConfig:
    """loss_spike (``--spike-threshold``, ``--spike-window``)."""

    threshold: float = 8.0
    """Robust z (median and MAD over the window) above which a loss or gradient norm is a spike."""
    window: int = 50
    """Steps of history a spike is measured against."""

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise UserError(f"--spike-threshold must be a positive number, got {self.threshold}", 2)
        if self.window < 10:
            raise UserError(f"--spike-window must be 10 steps or more, got {self.window}", 2)


@dataclass(kw_only=True)
class LossScaleConfig:
    """loss_scale (AMP loss scalers: torch.amp.GradScaler, DeepSpeed fp16)."""

    skipped_in_a_row: int = 5
    """Consecutive steps skipped for overflow after which the scale is said to keep collapsing."""
    min_scale: float = 1.0
    """A loss scale below this is a warning: gradients are scaled down, small ones vanish."""

    def __post_init__(self) -> None:
        if self.skipped_in_a_row < 2:
            raise UserError(f"loss_scale.skipped_in_a_row must be 2 or more, got {self.skipped_in_a_row}", 2)
        if not self.min_scale > 0:
            raise UserError(f"loss_scale.min_scale must be a positive number, got {self.min_scale}", 2)


@dataclass(kw_only=True)
class ReplicaDivergenceConfig:
    """replica_divergence (``--fingerprint-every``)."""

    every: int = 1
    """Cross-rank fingerprint check every K optimizer steps."""
    state_every: int = 8
    """Gradients and optimizer state join the parameters in the check at the first ``state_every``
    checked steps and at every ``state_every``-th after (1: every check). The parameters show any
    divergence in its step; the gradients tell how it came (reduced apart, or changed after the
    reduction), which the first steps tell for a broken setup. Three quarters of an Adam model's
    fingerprinting is gradients and moments (issue 18)."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise UserError(f"--fingerprint-every must be 1 or more, got {self.every}", 2)
        if self.state_every < 1:
            raise UserError(f"replica_divergence.state_every must be 1 or more, got {self.state_every}", 2)

    def state_checked(self, step: int) -> bool:
        """Whether a checked step fingerprints gradients and optimizer state too (the same on every rank)."""
        n = step // self.every  # the n-th checked step
        return self.state_every == 1 or n <= self.state_every or n % self.state_every == 0


WATCH_MODES = ("on-demand", "full")
"""nan_origin.watch's choices (``--nan-watch``)."""


@dataclass(kw_only=True)
class NanOriginConfig:
    """nan_origin (``--stop-on-nan``, ``--nan-watch``)."""

    stop: bool = False
    """End the job (EXIT_NAN) at the first non-finite loss, gradient, parameter or module output."""
    watch: str = "on-demand"
    """How the first module with a non-finite output is found. ``on-demand``: every step is watched as a
    whole (the loss, the local gradients, the parameters) and the step's inputs, generator states and
    parameters are held (one copy); only a step found non-finite is re-executed, its forward with every
    module watched. ``full``: every watched module's output is checked in every step's forward (no
    copy held; costs a reduction and a hooked call per module per step). Layouts whose forward cannot
    be re-executed on one rank alone (FSDP2, DeepSpeed, tensor or pipeline parallelism, SyncBatchNorm,
    a compiled model, several models) are watched in full whatever this says."""

    def __post_init__(self) -> None:
        if self.watch not in WATCH_MODES:
            raise UserError(f"--nan-watch {self.watch!r}: choose one of {', '.join(WATCH_MODES)}", 2)


@dataclass(kw_only=True)
class RerunConfig:
    """rerun (``--rerun-on-anomaly``)."""

    max_reruns: int = 3
    """Steps re-executed per rank and run at most (each costs two steps' compute on that rank)."""
    keep: int = 3
    """Captures of the last steps held (each a copy of the parameters and buffers, and of the step's inputs):
    a flag that comes through the cross-rank exchange a step or two late still finds its step."""

    def __post_init__(self) -> None:
        if self.max_reruns < 1 or self.keep < 2:
            raise UserError(f"rerun: max_reruns must be 1 or more and keep 2 or more, got {self.max_reruns} and "
                            f"{self.keep}", 2)


@dataclass(kw_only=True)
class ProfilerConfig:
    """profiler (``--profile-steps``, ``--profile-on-finding``)."""

    steps: str = ""
    """``A:B[,C:D]``: trace these optimizer steps with torch.profiler on every rank."""
    on_finding: int = 5
    """Steps traced on every rank after a detector fires (once per run); 0: off."""

    def __post_init__(self) -> None:
        try:
            parse_windows(self.steps)
        except ValueError as e:
            raise UserError(f"--profile-steps {self.steps}: {e}", 2) from None
        if self.on_finding < 0:
            raise UserError(f"--profile-on-finding must be 0 or more, got {self.on_finding}", 2)


def chosen_steps(spec: str) -> tuple[set[int], bool]:
    """``1-8,16,pow2``: ranges and single steps, comma-separated, and ``pow2`` (every power of two). Returns (the
    listed steps, whether powers of two are in); a UserError (one line, what to write) on anything else."""
    out: set[int] = set()
    pow2 = False
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            if part == "pow2":
                pow2 = True
            elif "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if not 1 <= a <= b:
                    raise ValueError
                out |= set(range(a, b + 1))
            elif int(part) >= 1:
                out.add(int(part))
            else:
                raise ValueError
        except ValueError:
            raise UserError(f"--parity-steps '{spec}': '{part}' is not a step (1 or more), a range A-B or pow2; "
                            "write e.g. 1-8,pow2 or 1-20,50,100", 2) from None
    if not out and not pow2:
        raise UserError(f"--parity-steps '{spec}' names no step; write e.g. 1-8,pow2", 2)
    return out, pow2


@dataclass(kw_only=True)
class ParityConfig:
    """parity (``attach --parity``, ``--parity-steps``): the recorder ``distdebug parity`` compares."""

    steps: str = "1-8,pow2"
    """The steps whose tensors are recorded: ranges and steps, comma-separated, and ``pow2`` (every power of two):
    the first steps, where a departure starts, then how rounding grows. The loss and the gradients' global norm
    are recorded at every step whatever this says."""
    twin: bool = False
    """This run is the reference's twin: the last bit of a random half of each parameter flipped every step."""
    seed: int = 0
    """The sketches' seed: two runs compared must use the same."""

    def __post_init__(self) -> None:
        chosen_steps(self.steps)


def parse_replica_groups(text: str) -> list[list[int]]:
    """``"0,2;1,3"`` -> [[0, 2], [1, 3]]; a UserError (one line, what to write) on anything else."""
    groups: list[list[int]] = []
    seen: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(";"))):
        try:
            ranks = sorted({int(r) for r in part.split(",") if r.strip()})
        except ValueError:
            raise UserError(f"--replica-groups '{text}': '{part}' is not a list of ranks; write groups of ranks "
                            "separated by ';', e.g. 0,2;1,3", 2) from None
        if not ranks or ranks[0] < 0 or seen & set(ranks):
            raise UserError(f"--replica-groups '{text}': each rank (0 or more) may be in one group only, "
                            "e.g. 0,2;1,3", 2)
        seen |= set(ranks)
        groups.append(ranks)
    if not groups:
        raise UserError(f"--replica-groups '{text}': no group given; write e.g. 0,2;1,3", 2)
    return groups


def parse_windows(text: str | None) -> list[tuple[int, int]]:
    """``"5:8,20:22"`` -> [(5, 8), (20, 22)]; ValueError with the reason on anything else."""
    out = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        a, sep, b = part.partition(":")
        if not sep:
            a = b = part
        try:
            start, end = int(a), int(b)
        except ValueError:
            raise ValueError(f"'{part}' is not A:B (optimizer steps)") from None
        if start < 2 or end < start:
            raise ValueError(f"'{part}': need 2 <= A <= B (step 1 is when the models are found)")
        out.append((start, end))
    return sorted(out)



SHORTHANDS: dict[str, tuple[str, str]] = {
    "fingerprint_every": ("replica_divergence", "every"),
    "stop_on_nan": ("nan_origin", "stop"),
    "nan_watch": ("nan_origin", "watch"),
    "spike_threshold": ("loss_spike", "threshold"),
    "spike_window": ("loss_spike", "window"),
    "profile_steps": ("profiler", "steps"),
    "profile_on_finding": ("profiler", "on_finding"),
}
"""attach's own options that set one detector option each: CLI name (underscored) -> (detector, option)."""


def option_default(detector_config: type, option: str) -> Any:
    """The default of one option of a detector's config dataclass (what the CLI's help shows)."""
    import dataclasses

    for f in dataclasses.fields(detector_config):
        if f.name == option:
            return f.default
    raise KeyError(option)


def build_options(detector_config: type, given: dict[str, Any], where: str) -> Any:
    """An instance of ``detector_config`` from options given as strings (or typed values); UserError
    on an unknown option or a value of the wrong type. ``where`` names the detector in messages."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(detector_config)
    known = {f.name: hints.get(f.name, str) for f in dataclasses.fields(detector_config) if f.init}
    typed: dict[str, Any] = {}
    for key, value in given.items():
        if key not in known:
            raise UserError(f"detector {where} has no option '{key}'; it takes {', '.join(known) or 'none'}", 2)
        typed[key] = _typed(known[key], value, f"{where}.{key}")
    return detector_config(**typed)


def _typed(kind: Any, value: Any, name: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        if kind is bool:
            low = value.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(value)
            return low in ("1", "true", "yes", "on")
        if kind in (int, float):
            return kind(value)
    except ValueError:
        raise UserError(f"{name} must be {getattr(kind, '__name__', kind)}, got '{value}'", 2) from None
    return value
