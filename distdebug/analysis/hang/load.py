"""Loading for the hang verdict: a run directory -> ``HangFacts`` (no judgement here).

Reads each rank's event stream (steps with per-step collective counts, ``stall`` and
``script_error`` records with stacks), its in-flight collective slot (``artifacts.inflight``,
survives a crash), its faulthandler crash stack, and the Flight Recorder's match of every rank's dump
(``flight_recorder``). What the records say is judged by ``judge.judge``, a pure function of the
facts, so that every rule can be tested on facts built by hand or loaded once from a recorded run.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from distdebug.analysis.hang.flight_recorder import flight_recorder_verdict
from distdebug.artifacts import layout, schema
from distdebug.artifacts.inflight import SLOT_EMPTY, SLOT_FAILED, SLOT_INSIDE, read_inflight
from distdebug.artifacts.reader import Run


class Status(str, enum.Enum):
    """What a rank's records say it was doing when the job ended or stalled (a str: reads as its value)."""

    RUNNING = "running"
    """No end record and no stall: still running, or killed without a chance to write."""
    STALLED = "stalled"
    """Its watchdog recorded no progress for the stall timeout (stacks and Flight Recorder dumped)."""
    RAISED = "raised"
    """The script raised (the script_error record)."""
    CRASHED = "crashed"
    """A fatal signal (faulthandler wrote crash.txt)."""
    EXITED = "exited"
    """The end record: the script returned or exited."""
    ABSENT = "absent"
    """No records at all: it never started."""


P2P_OPS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
"""Point-to-point operations: numbered apart from the collectives (their own counter, runtime.patches)."""


@dataclass
class RankState:
    rank: int
    status: Status
    step: int = 0
    phase: str | None = None
    pg_init: str | None = None
    inflight_state: str = SLOT_EMPTY
    inflight: dict[str, Any] | None = None
    moved_on: bool = False
    """It entered the collective it is in after its last stall record (which was outside it): it came out of
    its own long work a moment ago, and is not waiting in that collective long enough to be a waiter."""
    stack: list[dict[str, Any]] = field(default_factory=list)
    exit_code: int | None = None
    exception: str | None = None
    message: str | None = None
    collective_error: str | None = None
    crash_stack: str | None = None
    step_collectives: dict[int, int] = field(default_factory=dict)
    entered_total: int | None = None
    """Python-level collectives entered since the start (from the stall record)."""
    collectives_unlisted: int = 0
    """Collectives of the attempt's steps whose records are not in ``step_collectives`` (a rank read through its
    index keeps its last steps' records only; the digest has the sum of all: artifacts.digest)."""
    killed_by: str | None = None
    """The signal that ended it, when the launcher saw it die by one without an end record."""
    idle_s: float | None = None
    """Seconds without progress, from its last stall record."""
    stage: int | None = None
    """Its pipeline stage, from discovery's layout (None: not a pipeline)."""

    @property
    def in_progress_collectives(self) -> int | None:
        """Collectives already entered in the unfinished current step (a lower bound of its count)."""
        if self.entered_total is None:
            return None
        return max(0, self.entered_total - self.collectives_unlisted - sum(self.step_collectives.values()))

    @property
    def current_step(self) -> int:
        return self.step + 1


@dataclass(frozen=True)
class HangFacts:
    """Everything the hang verdict is judged from, loaded once; plain data (no file, no process)."""

    ranks: dict[int, RankState]
    """Every rank's state, by rank (ranks of the world size with no records: ABSENT)."""
    world_size: int = 0
    """From the ranks' start records (0: none started)."""
    flight_recorder: dict[str, Any] | None = None
    """The first collective PyTorch's analyzer found with missing ranks or a mismatch (see
    ``flight_recorder.flight_recorder_verdict``), ``{"error": ...}`` when it failed, None without one."""
    first_failure: tuple[int, int] | None = None
    """The launcher's first failed rank and its exit code (negative: the signal that killed it)."""


_FH_FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>.+)$')


def _crash_frames(text: str) -> list[dict[str, Any]]:
    """The main thread's frames from a faulthandler dump, innermost last.

    A fatal signal raised by a library thread (gloo aborts from its own thread) is printed under
    "Thread 0x..." blocks with no "Current thread"; the main thread is the one that runs the module.
    """
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    main = next((b for b in blocks if "_run_module_as_main" in b or "bootstrap.py" in b), blocks[-1])
    frames = []
    for line in main.splitlines():
        m = _FH_FRAME.search(line.strip())
        if m:
            frames.append({"file": m["file"], "line": int(m["line"]), "func": m["func"], "code": ""})
    return list(reversed(frames))  # faulthandler prints innermost first


def rank_state(rank: int, records: list[dict[str, Any]], inflight: tuple[str, dict[str, Any] | None],
               crash: str) -> RankState:
    """One rank's state from its last attempt's records, its in-flight slot and its crash dump ("" if none)."""
    st = RankState(rank=rank, status=Status.RUNNING)
    stall_entered: int | None = None  # the collectives the rank had entered when it recorded its last stall
    incomplete = False  # its writes failed (a full disk): step records stop there, the stall says where it is
    for r in records:
        kind = r.get("kind")
        if kind == schema.STEP:
            st.step = int(r.get("step", st.step))
            st.step_collectives[st.step] = int(r.get("collectives", 0))
        elif kind == schema.PG_INIT:
            st.pg_init = r.get("phase")
        elif kind == schema.STALL:
            st.status, st.phase, st.stack = Status.STALLED, r.get("phase"), r.get("main_stack") or []
            st.idle_s = r.get("idle_s")
            if isinstance(r.get("step"), int):
                st.step = max(st.step, r["step"])
            if r.get("collectives_entered") is not None and not incomplete:
                st.entered_total = int(r["collectives_entered"])
            stall_entered = r.get("collectives_entered") if isinstance(r.get("collectives_entered"), int) else None
        elif kind == schema.WRITE_FAILED:
            # The per-step counts stop here: what the rank entered since cannot be split into steps.
            incomplete, st.entered_total = True, None
        elif kind == schema.STALL_CLEARED:
            st.status = Status.RUNNING
        elif kind == schema.DISCOVERY and isinstance((r.get("layout") or {}).get("pipeline"), dict):
            st.stage = r["layout"]["pipeline"].get("index")
        elif kind == schema.SCRIPT_ERROR:
            st.status, st.exception, st.message = Status.RAISED, r.get("exception"), r.get("message")
            st.collective_error, st.stack = r.get("collective"), r.get("stack") or []
        elif kind == schema.END and st.status != Status.RAISED:
            st.status, st.exit_code = Status.EXITED, r.get("exit_code")
    st.inflight_state, st.inflight = inflight
    seq = (st.inflight or {}).get("seq")
    if (st.status == Status.STALLED and st.inflight_state == SLOT_INSIDE and stall_entered is not None
            and isinstance(seq, int) and (st.inflight or {}).get("op") not in P2P_OPS
            and "peer" not in (st.inflight or {}) and seq > stall_entered):
        # Collectives only: a point-to-point operation's number counts sends and receives, which the stall
        # record's collectives_entered does not (a pipeline issues many more of them: never comparable).
        # Its stall record is older than the collective it is in now: it stalled in its own work (an
        # evaluation longer than the stall timeout) and has since moved on into the next collective. Waiting
        # there since a moment ago is not a hang (the peers may be a second behind it out of the same work):
        # it is running until a stall record of its own says it is stuck in this collective.
        st.status, st.moved_on = Status.RUNNING, True
    if crash.strip():
        st.crash_stack = crash
        if st.status in (Status.RUNNING, Status.STALLED):
            st.status = Status.CRASHED
            st.stack = _crash_frames(crash)
    site = (st.inflight or {}).get("site")
    if not st.stack and site and st.inflight_state in (SLOT_INSIDE, SLOT_FAILED):
        # No stack of its own (a fatal-signal dump cut short when the launcher stopped the rank): the
        # script's line that called the collective it died in, from the in-flight record.
        st.stack = [{**site, "code": ""}]
    return st


def rank_states(run: Run, world_size: int | None = None) -> dict[int, RankState]:
    """Every rank's state, read from its folder of the run directory; ranks below world_size with no
    folder are ABSENT."""
    states: dict[int, RankState] = {}
    for rank, stream in run.ranks.items():
        try:
            crash = layout.crash_path(run.dir_of(rank), rank).read_text()
        except FileNotFoundError:
            crash = ""
        st = states[rank] = rank_state(rank, stream.last_attempt(),
                                       read_inflight(layout.inflight_path(run.dir_of(rank), rank)), crash)
        st.collectives_unlisted = max(0, stream.digest.collectives - sum(st.step_collectives.values()))
    for rank in range(world_size or 0):
        states.setdefault(rank, RankState(rank=rank, status=Status.ABSENT))
    return dict(sorted(states.items()))


def world_size(run: Run) -> int:
    """The world size the ranks' start records state (0: no rank started)."""
    return max([int(s.get("world_size", 0)) for st in run.ranks.values() for s in st.of_kind(schema.START)] + [0])


def load_facts(run: Run, first_failure: tuple[int, int] | None = None) -> HangFacts:
    """The facts of a run for the hang verdict: each rank's state and the Flight Recorder's match.

    first_failure: (rank, exit code) of the launcher's first failed rank, negative for a signal.
    """
    world = world_size(run)
    return HangFacts(ranks=rank_states(run, world), world_size=world,
                     flight_recorder=flight_recorder_verdict(run, world) if world else None,
                     first_failure=first_failure)
