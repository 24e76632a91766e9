"""The hang verdict: a pure function of ``HangFacts`` (no file, no process, no clock).

Verdict order: a startup hang (init_process_group), then a mismatched collective (same sequence
number, different op or shapes), then missing ranks (ranks waiting in a collective that one rank
never reached), each naming culprit ranks, the collective, and the culprit's own stack.

No kill without a culprit: when the facts name none (no rank waits in a collective that another
has not entered, the Flight Recorder shows no missing rank, the collective counts agree and no rank
ended), every rank is busy in its own work (a long evaluation, a checkpoint save, compilation,
data preparation). That is a ``stall`` warning with every rank's stack (``is_busy_stall``), which
the launcher reports and lets the job go on. With NCCL a collective returns once enqueued and a
rank then waits at its next host synchronisation, not inside the collective call: there the
Flight Recorder's entries (enqueued on some ranks, missing on others) carry the evidence.

The findings the launcher's supervisor needs of its own (a stall with nothing to name, a rendezvous
that never completed) are built here too: findings are made in ``analysis/`` only.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from distdebug.analysis.hang.load import P2P_OPS, HangFacts, RankState, Status
from distdebug.analysis.teardown import how
from distdebug.artifacts.inflight import SLOT_FAILED, SLOT_INSIDE
from distdebug.findings import Finding, Severity

DETECTOR = "hang"
BUSY_STALL = "stall"
"""Subject of the warning for a stall with no culprit (every rank busy in its own work)."""
_LIBRARY_MARKERS = (
    f"{os.sep}site-packages{os.sep}", f"{os.sep}distdebug{os.sep}", "<frozen ", f"{os.sep}lib{os.sep}python3",
)




def user_frame(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost frame in the user's code (not torch, not distdebug, not the standard library)."""
    for f in reversed(frames):
        if not any(m in str(f.get("file", "")) for m in _LIBRARY_MARKERS):
            return f
    return frames[-1] if frames else None


def where(frames: list[dict[str, Any]]) -> str:
    f = user_frame(frames)
    if f is None:
        return "an unknown place"
    code = f": {f['code']}" if f.get("code") else ""
    return f"{Path(str(f['file'])).name}:{f['line']} in {f['func']}{code}"



_CONNECTION_WORDS = re.compile(
    r"connect|refused|unreachable|timed? ?out|timeout|address|rendezvous|socket|interface|store|network|"
    r"broken pipe|reset by peer|no route|resolve|hostname", re.IGNORECASE)
_CONNECTION_TYPES = ("DistNetworkError", "DistStoreError", "RendezvousError", "TimeoutError", "ConnectionError",
                     "ConnectionRefusedError", "ConnectionResetError", "socket.gaierror", "gaierror", "OSError")


def is_connection_error(exception: str | None, message: str | None) -> bool:
    """Whether an init_process_group error is about reaching the other ranks (not a bad argument)."""
    name = (exception or "").rsplit(".", 1)[-1]
    if name in _CONNECTION_TYPES:
        return True
    if name in ("ValueError", "TypeError", "AssertionError", "NotImplementedError", "KeyError", "AttributeError"):
        return False
    return bool(_CONNECTION_WORDS.search(message or ""))






def _p2p_text(info: dict[str, Any], named: bool = False) -> str:
    """``to rank 1`` / ``from rank 0 (tag 3)``; ``named``: with the operation (``isend to rank 1``)."""
    to = info.get("op") in ("send", "isend")
    text = f"{'to' if to else 'from'} rank {info.get('peer')}" + (f" (tag {info['tag']})" if info.get("tag") else "")
    return f"{info.get('op')} {text}" if named else text


def _describe(st: RankState) -> str:
    text = _describe_rank(st)
    if st.stage is not None:  # "rank 1 (pipeline stage 1) is ..."
        text = text.replace(f"rank {st.rank} ", f"rank {st.rank} (pipeline stage {st.stage}) ", 1)
    return text


def _describe_rank(st: RankState) -> str:
    if st.status == Status.EXITED:
        return f"rank {st.rank} exited with code {st.exit_code} after step {st.step}"
    if st.status == Status.ABSENT:
        return f"rank {st.rank} never started (no records)"
    if st.status == Status.RAISED:
        return f"rank {st.rank} raised {st.exception} at step {st.current_step} ({where(st.stack)})"
    if st.status == Status.CRASHED:
        return f"rank {st.rank} died by a fatal signal at step {st.current_step} in {where(st.stack)}"
    inside = st.inflight if st.inflight_state == SLOT_INSIDE else None
    if inside:
        peer = ""
        if inside.get("peer") is not None:  # a point-to-point operation: which peer this side waits for
            peer = " " + _p2p_text(inside)
        elif inside.get("ops"):  # batch_isend_irecv: each operation of the batch
            peer = " (" + ", ".join(_p2p_text(o, named=True) for o in inside["ops"]) + ")"
        waiting = " (waiting in Work.wait())" if inside.get("waiting") else ""
        return f"rank {st.rank} is inside {inside['op']}{peer} #{inside['seq']}{waiting} at step {st.current_step}"
    if st.status == Status.RUNNING and st.killed_by:
        return (f"rank {st.rank} was killed by {st.killed_by} during step {st.current_step} "
                f"(no record after step {st.step})")
    if st.status == Status.RUNNING:
        return (f"rank {st.rank} left no record after step {st.step} "
                "(killed by a signal, or still running without having stalled)")
    return f"rank {st.rank} is stuck at step {st.current_step} in {where(st.stack)}"


def first_collective_count_difference(states: dict[int, RankState]) -> dict[str, Any] | None:
    """The first step in which some rank provably issued fewer Python-level collectives than another.

    Completed steps give exact counts; a rank stuck in its current step gives a lower bound (what
    it already entered). A rank that completed step s with fewer collectives than another rank's
    count (exact or lower bound) for s skipped one there.
    """
    steps = sorted(set().union(*(s.step_collectives for s in states.values())) if states else [])
    partial = {r: (s.current_step, s.in_progress_collectives) for r, s in states.items()
               if s.in_progress_collectives is not None}
    for step in sorted(set(steps) | {p[0] for p in partial.values()}):
        exact = {r: s.step_collectives[step] for r, s in states.items() if step in s.step_collectives}
        at_least = {r: int(n) for r, (st, n) in partial.items() if st == step and n is not None}
        if not exact:
            continue
        if len(set(exact.values())) > 1 or any(n > min(exact.values()) for n in at_least.values()):
            return {"step": step, "collectives_per_rank": {**exact, **at_least}}
    return None


def odd_ranks_out(count_diff: dict[str, Any] | None, states: dict[int, RankState]) -> list[int]:
    """Ranks that provably issued a different number of collectives in the first differing step.

    Only ranks that completed that step count (their number is exact). With a strict majority
    agreeing on one number, the others are the odd ones out; without one (two ranks, a tie), the
    ranks with fewer (a skipped collective, the commoner bug; the message says the other reading).
    This does not depend on when each rank's stall record was written, so it decides the culprit
    whenever it exists.
    """
    if not count_diff:
        return []
    step = count_diff["step"]
    exact = {r: s.step_collectives[step] for r, s in states.items() if step in s.step_collectives}
    if len(set(exact.values())) < 2:
        return []
    tally: dict[int, int] = {}
    for n in exact.values():
        tally[n] = tally.get(n, 0) + 1
    top, votes = max(tally.items(), key=lambda kv: kv[1])
    if votes * 2 > len(states) and list(tally.values()).count(votes) == 1:
        return sorted(r for r, n in exact.items() if n != top)
    low = min(exact.values())
    return sorted(r for r, n in exact.items() if n == low)


def _inflight_of(st: RankState) -> dict[str, Any] | None:
    """The collective a rank is (or was, when it failed) inside; None if it stopped elsewhere."""
    if st.inflight_state in (SLOT_INSIDE, SLOT_FAILED):
        return st.inflight
    if st.status == Status.RAISED and st.collective_error and st.inflight is not None:
        return st.inflight  # the collective it failed in (the slot keeps the last one)
    return None


FUNCTIONAL_WAIT = {"op": "wait_tensor", "seq": "?", "shapes": None, "functional": True}
"""What a rank blocked on a functional collective's result is said to wait in (no in-flight record of ours)."""


def functional_wait(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A rank blocked waiting for a functional collective's result (DTensor's redistribution, tensor
    parallelism's all-reduce, ``torch.distributed._functional_collectives``): the collective was issued
    asynchronously and the wait runs where its result is first used, inside torch, not inside any
    collective the harness wraps. Its innermost frame (past the operator call) is ``wait_tensor``: it
    waits for its peers like a rank inside a collective, and is no culprit."""
    for f in reversed(frames):
        name = str(f.get("file", "")).replace("\\", "/")
        if name.endswith("/torch/_ops.py"):
            continue
        if name.endswith("/torch/distributed/_functional_collectives.py") and f.get("func") == "wait_tensor":
            return dict(FUNCTIONAL_WAIT)
        return None
    return None


def _fix(kind: str) -> str:
    return {
        "init": "make every rank reach init_process_group: look at the stack of the ranks that did not",
        "mismatch": "every rank must issue the same collectives in the same order with the same shapes; "
                    "look for rank-dependent branches around the collective",
        "killed": "the rank was killed from outside: look at the kernel log (dmesg: the OOM killer), the "
                  "node's memory and the scheduler's log for that node at that time",
        "missing": "the named rank took a different path (a skipped collective, an early exit, a stuck "
                   "data loader or an endless loop): its stack shows where",
    }[kind]


def _mark_killed(states: dict[int, RankState], first_failure: tuple[int, int] | None) -> RankState | None:
    """The launcher saw rank R die by a signal and R left no end record: mark it killed and return it."""
    if first_failure is None:
        return None
    rank, exit_code = first_failure
    st = states.get(rank)
    if st is None or exit_code >= 0 or st.status != Status.RUNNING:
        return None
    st.killed_by = how(exit_code)
    return st


def _killed_rank_finding(states: dict[int, RankState], killed: RankState | None) -> list[Finding]:
    """A rank killed from outside, named from the launcher and its own last record.

    Why from the launcher and not from the survivors: when one rank is killed (the OOM killer, a
    node agent, a SIGKILL), the others may be stopped by torch's launcher before they fail in their
    next collective and record it; the launcher's first failure and the killed rank's last step
    record are enough to say what happened, whatever the survivors managed to write.
    """
    if killed is None:
        return []
    others = sorted(r for r in states if r != killed.rank)
    return [Finding(
        severity=Severity.CRITICAL, detector=DETECTOR, ranks=[killed.rank], step=killed.current_step,
        subject=f"rank {killed.rank}",
        message=f"{_describe(killed)}; the launcher then stopped rank(s) {others}",
        evidence={"ranks": {r: {"status": s.status, "last_step": s.step, "phase": s.phase}
                            for r, s in states.items()}, "signal": killed.killed_by},
        fix=_fix("killed"),
    )]


def _busy_stall(states: dict[int, RankState]) -> Finding:
    """No rank waits for another: every stalled rank is inside its own work. A warning, not a verdict."""
    stalled = sorted(r for r, s in states.items() if s.status == Status.STALLED)
    idle = min((s.idle_s for s in states.values() if s.idle_s is not None), default=None)
    took = f" for {idle:.0f}s" if idle is not None else ""
    return Finding(
        severity=Severity.WARNING, detector=DETECTOR, ranks=stalled,
        step=min((states[r].current_step for r in stalled), default=None), subject=BUSY_STALL,
        message=f"no progress{took} on rank(s) {stalled}, and no rank waits in a collective that another has not "
                "entered: every rank is busy in its own work (a long evaluation, a checkpoint save, compilation, "
                "data preparation?); the job goes on. "
                + "; ".join(f"rank {r} is in {where(states[r].stack)}" for r in stalled),
        evidence={"ranks": {r: {"status": s.status, "last_step": s.step, "phase": s.phase} for r, s in states.items()},
                  "stacks": {r: states[r].stack[-8:] for r in stalled}},
        fix="nothing, if this work is expected to take that long (a --stall-timeout above the longest evaluation or "
            "save stops the warning; before the first step, --startup-timeout); if it never ends, each rank's "
            "stacks.txt shows where it is; "
            "--on-stall abort ends a job on such a stall",
    )


def is_busy_stall(findings: list[Finding]) -> bool:
    """The diagnosis found no culprit: a stall of ranks that are all busy in their own work."""
    return len(findings) == 1 and findings[0].detector == DETECTOR and findings[0].subject == BUSY_STALL



def judge(facts: HangFacts) -> list[Finding]:
    """Findings that explain a hang or a failed collective; empty when nothing is wrong (pure: the facts only)."""
    states = {r: replace(s) for r, s in facts.ranks.items()}  # marking the killed rank leaves the facts as given
    killed = _mark_killed(states, facts.first_failure)
    bad = [s for s in states.values() if s.status in (Status.STALLED, Status.RAISED, Status.CRASHED)]
    if not bad or not any(s.status == Status.STALLED or s.collective_error or s.status == Status.CRASHED for s in bad):
        return _killed_rank_finding(states, killed)
    count_diff = first_collective_count_difference(states)
    evidence: dict[str, Any] = {
        "ranks": {r: {"status": s.status, "last_step": s.step, "phase": s.phase, "in_collective": _inflight_of(s),
                      # the backend's own words, where the rank raised (gloo's size check, NCCL's timeout)
                      **({"error": f"{s.exception}: {s.message}"[:500]} if s.status == Status.RAISED else {})}
                  for r, s in states.items()},
    }
    if count_diff:
        evidence["first_step_with_different_collective_counts"] = count_diff
    inflight = {r: info for r, s in states.items() if (info := _inflight_of(s)) is not None}
    fr = facts.flight_recorder
    return (_startup(states, evidence) or _mismatch(states, inflight, fr, evidence)
            or _missing(states, inflight, fr, count_diff, killed, evidence))


def _startup(states: dict[int, RankState], evidence: dict[str, Any]) -> list[Finding] | None:
    """A) a rank's init_process_group raised, or nobody finished it while some rank never called it."""
    # Its own error (a bad argument) is said as such; only an error about reaching the others is a
    # connection verdict with network advice.
    failed_init = [s for s in states.values() if s.status == Status.RAISED and s.pg_init == "begin" and s.step == 0]
    if failed_init and not any(s.pg_init == "done" and s.step > 0 for s in states.values()):
        own = [s for s in failed_init if not is_connection_error(s.exception, s.message)]
        if own:
            first = own[0]
            text = (first.message or "").strip().splitlines()[0][:300] if first.message else ""
            return [Finding(
                severity=Severity.ERROR, detector="startup", ranks=sorted(s.rank for s in own), step=None,
                subject="init_process_group",
                message=f"init_process_group raised on rank(s) {sorted(s.rank for s in own)} at start-up: "
                        f"{first.exception}: {text} (the script's own error, not a connection problem)",
                evidence={"stacks": {s.rank: s.stack[-8:] for s in own}},
                fix="change the init_process_group call as the error says (the stack names the line)",
            )]
        first = failed_init[0]
        text = (first.message or "").strip().splitlines()[0][:300] if first.message else ""
        # The launcher ends the others as soon as one rank fails: they may die inside init, unrecorded.
        still = sorted(s.rank for s in states.values() if s.pg_init == "begin" and s not in failed_init)
        never = sorted(s.rank for s in states.values() if s.pg_init is None and s.status != Status.RAISED)
        tail = (f"; rank(s) {still} were still in init_process_group when the job ended" if still else "") + \
            (f"; rank(s) {never} left no record of reaching it (ended by the launcher)" if never else "")
        return [Finding(
            severity=Severity.CRITICAL, detector=DETECTOR, ranks=sorted(s.rank for s in failed_init), step=None,
            subject="init_process_group",
            message=f"init_process_group failed on rank(s) {sorted(s.rank for s in failed_init)}: the ranks could "
                    f"not form the process group ({first.exception}: {text}){tail}; no collective ran",
            evidence={**evidence, "stacks": {s.rank: s.stack[-8:] for s in failed_init}},
            fix="the ranks must reach each other: MASTER_ADDR/MASTER_PORT reachable from every node, "
                "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME naming a real interface (distdebug doctor checks both), "
                "the same world size everywhere; the error above names the address that failed",
        )]
    # A2) nobody finished init_process_group.
    if all(s.pg_init != "done" and s.step == 0 for s in states.values()):
        in_init = sorted(r for r, s in states.items() if s.pg_init == "begin")
        late = [s for s in states.values() if s.pg_init != "begin"]
        if in_init and late:
            return [Finding(
                severity=Severity.CRITICAL, detector=DETECTOR, ranks=[s.rank for s in late], step=None,
                subject="init_process_group",
                message=f"ranks {in_init} wait in init_process_group; "
                        + "; ".join(_describe(s) if s.status != Status.STALLED else
                                    f"rank {s.rank} never called it: stuck in {where(s.stack)}" for s in late),
                evidence={**evidence, "stacks": {s.rank: s.stack[-8:] for s in late}}, fix=_fix("init"),
            )]
    return None


def _mismatch(states: dict[int, RankState], inflight: dict[int, dict[str, Any]], fr: dict[str, Any] | None,
              evidence: dict[str, Any]) -> list[Finding] | None:
    """B) same sequence number, different op or shapes: from the in-flight slots, then the Flight Recorder."""
    by_seq: dict[int, dict[int, dict[str, Any]]] = {}
    for r, info in inflight.items():
        by_seq.setdefault(int(info["seq"]), {})[r] = info
    for n, infos in sorted(by_seq.items()):
        kinds = {(i["op"], str(i.get("shapes"))) for i in infos.values()}
        if any(i["op"] in P2P_OPS for i in infos.values()):
            continue  # sends meet receives, and pipeline stages issue different numbers of them: not a mismatch
        if len(infos) > 1 and len(kinds) > 1:
            desc = ", ".join(f"rank {r} {i['op']} {i.get('shapes')}" for r, i in sorted(infos.items()))
            first_step = min(i["step"] for i in infos.values())
            return [Finding(
                severity=Severity.CRITICAL, detector=DETECTOR, ranks=sorted(infos), step=first_step,
                subject=f"collective #{n}",
                message=f"ranks disagree on collective #{n} (step {first_step}): {desc}; "
                        + "; ".join(_describe(states[r]) for r in sorted(infos)),
                evidence={**evidence, "flight_recorder": fr,
                          "stacks": {r: states[r].stack[-8:] for r in sorted(infos)}},
                fix=_fix("mismatch"),
            )]
    if fr and fr.get("mismatch"):
        return [Finding(
            severity=Severity.CRITICAL, detector=DETECTOR, ranks=fr["expected_ranks"], step=None,
            subject=f"{fr['op']} #{fr['seq']} on {fr['process_group']}",
            message=f"Flight Recorder: collective #{fr['seq']} ({fr['op']}, sizes {fr['input_sizes']}) "
                    f"does not match across ranks: {fr['mismatch']}",
            evidence={**evidence, "flight_recorder": fr}, fix=_fix("mismatch"),
        )]
    return None


def _missing(states: dict[int, RankState], inflight: dict[int, dict[str, Any]], fr: dict[str, Any] | None,
             count_diff: dict[str, Any] | None, killed: RankState | None, evidence: dict[str, Any]) -> list[Finding]:
    """C) some ranks wait in a collective that others never reached; without a culprit, a busy stall."""
    # Waiting also for a functional collective's result: after the ranks in a collective of ours, so that
    # one of those is quoted.
    waiting = {r: i for r, i in inflight.items() if states[r].status in (Status.STALLED, Status.RAISED)}
    for r, st in sorted(states.items()):
        if r not in waiting and st.status == Status.STALLED:
            fw = functional_wait(st.stack)
            if fw is not None:
                waiting[r] = fw
    odd = odd_ranks_out(count_diff, states)
    ended = [s for s in states.values()
             if s.status in (Status.RAISED, Status.CRASHED, Status.EXITED, Status.ABSENT) or s.killed_by]
    # even one not yet stalled, but not one that entered it a moment ago, out of its own long work (moved_on)
    inside = any(st.inflight_state == SLOT_INSIDE and not st.moved_on for st in states.values())
    if not waiting and not inside and not (fr and fr.get("missing_ranks")) and not odd and not ended:
        return [_busy_stall(states)]
    op: str
    seq: Any
    sizes: Any
    if fr and fr.get("missing_ranks"):
        # Missing from the Flight Recorder's collective, but waiting in an earlier one of their own (a TP peer
        # waiting for the blocked rank's functional all-reduce): waiters, not culprits, while another is not.
        culprits = [r for r in fr["missing_ranks"] if r not in waiting] or list(fr["missing_ranks"])
        op, seq, sizes = fr["op"], fr["seq"], f"{fr['input_sizes']}, group {fr['process_group']}"
        at = where([{"file": f["file"], "line": f["line"], "func": f["func"]} for f in reversed(fr["frames"])]) \
            if fr["frames"] else "?"
        waiters = sorted(r for r in states if r not in culprits and states[r].status != Status.ABSENT)
    else:
        culprits = sorted(r for r, s in states.items() if r not in waiting)
        if not waiting or not culprits:
            gone = (Status.STALLED, Status.CRASHED, Status.EXITED, Status.ABSENT)
            culprits = sorted(r for r, s in states.items() if s.status in gone and s.rank not in waiting) \
                or sorted(states)
        waited = next(iter(waiting.values()), None)
        op = waited["op"] if waited else "a collective"
        seq = waited["seq"] if waited else "?"
        sizes = waited.get("shapes") if waited else None
        at = where(states[next(iter(waiting))].stack) if waiting else "?"
        waiters = sorted(waiting)
    if odd and len(odd) < len(states):
        # The count difference is proof; which rank happened to be waiting when the records were
        # written is timing (a rank that skipped one all_reduce later waits in its own last one).
        culprits = odd
        waiters = [r for r in waiters if r not in culprits]
    step = min((states[r].current_step for r in culprits if r in states), default=None)
    if count_diff and culprits:
        # Where it went wrong, not where it stopped: the step in which the culprits issued fewer
        # collectives than the others (a skipped all_reduce shows here, and only here).
        counts = count_diff["collectives_per_rank"]
        if culprits == odd or (all(r in counts for r in culprits)
                               and max(counts[r] for r in culprits) < max(counts.values())):
            step = count_diff["step"]
    located = f" (step {count_diff['step']} is the first with different collective counts: " \
              f"{count_diff['collectives_per_rank']})" if count_diff else ""
    functional = [r for r in waiters if (waiting.get(r) or {}).get("functional")]
    plain = [r for r in waiters if r not in functional]
    head = f"ranks {plain} wait in {op} #{seq} (sizes {sizes}, called at {at}); " if plain else \
        f"{op} #{seq} (sizes {sizes}, called at {at}) never completed; "
    subject = f"{op} #{seq}"
    if functional and not plain:
        subject = "a functional collective (DTensor, tensor parallelism)"
        head = f"ranks {waiters} wait for {subject} to complete (at {at}); "
    elif functional:
        head += f"ranks {functional} wait for a functional collective (DTensor, tensor parallelism) to complete; "
    described = [r for r in culprits if r in states]
    p2p = [r for r in waiters if (waiting.get(r) or {}).get("op") in P2P_OPS]
    if p2p:
        # Point-to-point (pipeline stages, hand-written send/recv): each side waits for its own peer in its
        # own operation; one "ranks wait in send" would say the receivers send.
        head = "ranks wait in point-to-point operations: " + "; ".join(_describe(states[r]) for r in p2p) + "; "
        described = [r for r in described if r not in p2p]
    return [Finding(
        severity=Severity.CRITICAL, detector=DETECTOR, ranks=list(culprits), step=step,
        subject=subject,
        message=(head + "; ".join(_describe(states[r]) for r in described)).rstrip("; ") + located,
        evidence={**evidence, "flight_recorder": fr,
                  "stacks": {r: states[r].stack[-8:] for r in culprits if r in states}},
        fix=_fix("killed" if killed is not None and killed.rank in culprits else "missing"),
    )]


# ---------------------------------------------------------------- the supervisor's own findings
def stall_without_culprit(stalled: list[int], stall_timeout: float) -> Finding:
    """The launcher saw ranks stall, and ``judge`` named nothing (e.g. one rank alone idle): a warning.
    ``stall_timeout``: the timeout that made the stall (the start-up allowance before a rank's first step)."""
    return Finding(
        severity=Severity.WARNING, detector=DETECTOR, ranks=sorted(stalled), step=None,
        subject=BUSY_STALL, message=f"no progress for {stall_timeout:g}s on ranks "
                                    f"{sorted(stalled)}; no culprit found: the job goes on",
        evidence={}, fix="see the ranks' stacks.txt in the run directory",
    )


def rendezvous_incomplete(*, expected_nodes: int, present: list[int], stall_timeout: float, host: str) -> Finding:
    """No rank started within the start-up allowance after the launch: some nodes' launchers never joined.

    present: the nodes whose launcher wrote its node file in this run directory.
    """
    missing = [n for n in range(expected_nodes) if n not in present]
    msg = (f"rendezvous not complete after {stall_timeout:g}s: {expected_nodes} nodes expected, "
           f"launchers seen in this run directory: nodes {present}")
    if missing:
        msg += f"; missing: nodes {missing}"
    return Finding(
        severity=Severity.CRITICAL, detector=DETECTOR, ranks=[], step=None, subject="rendezvous", message=msg,
        evidence={"expected_nodes": expected_nodes, "nodes_present": present, "nodes_missing": missing,
                  "host": host},
        fix="start 'distdebug attach' (same --rdzv-endpoint and --rdzv-id) on the missing nodes, or check that "
            "they can reach the endpoint",
    )
