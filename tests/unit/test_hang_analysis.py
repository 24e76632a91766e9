"""Tier 1 (pure): hang analysis on synthetic per-rank records, the in-flight slot and crash-stack parsing;
the judgement (``judge``) on facts built by hand (no file) and on the golden hung run loaded once."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from distdebug.analysis.hang import (
    HangFacts,
    RankState,
    Status,
    diagnose,
    functional_wait,
    is_busy_stall,
    judge,
    load_facts,
    rank_states,
    where,
)
from distdebug.analysis.hang.judge import first_collective_count_difference
from distdebug.analysis.hang.load import _crash_frames
from distdebug.artifacts import layout, schema
from distdebug.artifacts.inflight import SLOT_FINISHED, SLOT_INSIDE, InflightSlot, read_inflight
from distdebug.artifacts.reader import load_run
from distdebug.artifacts.writer import EventWriter
from distdebug.findings import Severity

USER = {"file": "/home/me/train.py", "line": 40, "func": "<module>", "code": "time.sleep(600)"}
TORCH = {"file": "/x/site-packages/torch/distributed/distributed_c10d.py", "line": 3252, "func": "all_reduce",
         "code": "work.wait()"}


def write(run_dir, rank, records, world=3):
    w = EventWriter(layout.events_path(run_dir, rank))
    w.write(schema.record(schema.START, rank=rank, world_size=world, pid=1, host="h"))
    for r in records:
        w.write(r)
    w.close()


def steps(counts):
    return [schema.record(schema.STEP, step=i, collectives=c) for i, c in enumerate(counts, 1)]


def test_inflight_slot_round_trip(tmp_path):
    slot = InflightSlot(tmp_path / "inflight")
    assert read_inflight(tmp_path / "inflight") == ("empty", None)
    slot.enter({"op": "all_reduce", "seq": 7, "shapes": [[4]]})
    assert read_inflight(tmp_path / "inflight") == ("inside", {"op": "all_reduce", "seq": 7, "shapes": [[4]]})
    slot.leave()
    assert read_inflight(tmp_path / "inflight")[0] == "finished"
    slot.enter({"op": "broadcast", "seq": 8, "shapes": [[2]]})
    slot.fail()  # the collective raised: the slot keeps it even if the rank is killed right after
    assert read_inflight(tmp_path / "inflight") == ("failed", {"op": "broadcast", "seq": 8, "shapes": [[2]]})


def test_where_prefers_the_users_frame():
    assert where([USER, TORCH]) == "train.py:40 in <module>: time.sleep(600)"


def test_faulthandler_dump_main_thread_is_found_when_another_thread_aborted():
    text = (
        "Fatal Python error: Aborted\n\nThread 0x01 (most recent call first):\n"
        '  File "/x/threading.py", line 982 in run\n\n'
        "Thread 0x02 (most recent call first):\n"
        '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "/home/me/train.py", line 53 in <module>\n'
        '  File "<frozen runpy>", line 198 in _run_module_as_main\n'
    )
    frames = _crash_frames(text)
    assert frames[-1]["func"] == "all_reduce" and where(frames) == "train.py:53 in <module>"


def test_first_step_with_different_collective_counts(tmp_path):
    write(tmp_path, 0, steps([2, 2, 2]))
    write(tmp_path, 1, steps([2, 1, 2]))
    write(tmp_path, 2, steps([2, 2]))
    states = rank_states(load_run(tmp_path))
    assert first_collective_count_difference(states) == {"step": 2, "collectives_per_rank": {0: 2, 1: 1, 2: 2}}


def test_a_rank_whose_writes_failed_is_placed_by_its_stall_not_by_its_last_step_record(tmp_path):
    """A full disk stopped rank 0's step records at step 2 and rank 1's at step 3; the job hung at step 40.
    The ranks are where their stall records say, and the collectives they entered since the records stopped
    are not taken for one step's count (which would name step 3 as the first with different counts)."""
    failed = schema.record(schema.WRITE_FAILED, step=2, error="ENOSPC: No space left on device", lost="step")
    write(tmp_path, 0, steps([2, 2]) + [failed, schema.record(schema.STALL, step=39, phase="training",
                                                                collectives_entered=80, main_stack=[USER])], world=2)
    write(tmp_path, 1, steps([2, 2, 2]) + [{**failed, "step": 3}, schema.record(
        schema.STALL, step=39, phase="training", collectives_entered=79, main_stack=[USER, TORCH])], world=2)
    states = rank_states(load_run(tmp_path))
    assert (states[0].step, states[1].step) == (39, 39)
    assert states[0].in_progress_collectives is None and states[1].in_progress_collectives is None
    assert first_collective_count_difference(states) is None


def test_rank_behind_is_named_by_majority_of_waiting_ranks(tmp_path):
    for rank in (0, 2):
        write(tmp_path, rank, steps([1, 1]) + [schema.record(schema.STALL, step=2, phase="training",
                                                             main_stack=[USER, TORCH])])
        InflightSlot(layout.inflight_path(tmp_path, rank)).enter({"op": "all_reduce", "seq": 3, "step": 3,
                                                                   "shapes": [[8]]})
    write(tmp_path, 1, steps([1, 1]) + [schema.record(schema.STALL, step=2, phase="training", main_stack=[USER])])
    (f,) = diagnose(load_run(tmp_path))
    assert f.ranks == [1] and f.step == 3 and f.subject == "all_reduce #3"
    assert "ranks [0, 2] wait in all_reduce #3" in f.message and "train.py:40" in f.message


def test_every_rank_busy_in_its_own_work_is_a_warning_with_no_culprit(tmp_path):
    # Both ranks stalled outside any collective (an evaluation), counts equal, nobody ended: no culprit.
    for rank in (0, 1):
        write(tmp_path, rank, steps([1, 1]) + [schema.record(schema.STALL, step=2, phase="training", idle_s=31.0,
                                                             main_stack=[USER])], world=2)
    findings = diagnose(load_run(tmp_path))
    assert is_busy_stall(findings)
    (f,) = findings
    assert (f.severity, f.subject, f.ranks, f.step) == (Severity.WARNING, "stall", [0, 1], 3)
    assert "no progress for 31s" in f.message and "rank 1 is in train.py:40" in f.message


def test_one_rank_waiting_for_a_busy_one_names_the_busy_one(tmp_path):
    # The twin with a culprit: rank 0 waits inside all_reduce #3, rank 1 never entered it.
    stall = schema.record(schema.STALL, step=2, phase="training", main_stack=[USER])
    write(tmp_path, 0, steps([1, 1]) + [stall], world=2)
    InflightSlot(layout.inflight_path(tmp_path, 0)).enter({"op": "all_reduce", "seq": 3, "step": 3, "shapes": [[8]]})
    write(tmp_path, 1, steps([1, 1]) + [stall], world=2)
    findings = diagnose(load_run(tmp_path))
    assert not is_busy_stall(findings)
    (f,) = findings
    assert (f.severity, f.ranks, f.subject) == (Severity.CRITICAL, [1], "all_reduce #3")


@pytest.mark.parametrize("entered_at_stall,hang", [(2, False), (3, True)])
def test_a_rank_that_entered_its_collective_after_its_stall_record_is_not_waiting_yet(tmp_path, entered_at_stall,
                                                                                      hang):
    """Both ranks evaluated past the stall timeout (stall records, no collective); rank 0 came out of it first
    and has just entered all_reduce #3 while rank 1 is a moment behind: not a hang (the verdict that ended a
    healthy job under load). Its twin: rank 0's stall record says it was already inside #3 (it entered 3
    collectives), and rank 1 never came: rank 1 is named."""
    write(tmp_path, 0, steps([1, 1]) + [schema.record(schema.STALL, step=2, phase="training", main_stack=[USER],
                                                      collectives_entered=entered_at_stall)], world=2)
    InflightSlot(layout.inflight_path(tmp_path, 0)).enter({"op": "all_reduce", "seq": 3, "step": 3, "shapes": [[8]]})
    write(tmp_path, 1, steps([1, 1]) + [schema.record(schema.STALL, step=2, phase="training", main_stack=[USER],
                                                      collectives_entered=2)], world=2)
    findings = diagnose(load_run(tmp_path))
    if hang:
        (f,) = findings
        assert (f.severity, f.ranks, f.subject) == (Severity.CRITICAL, [1], "all_reduce #3")
    else:
        assert all(f.severity != Severity.CRITICAL for f in findings), findings


@pytest.mark.parametrize("op", ["batch_isend_irecv", "send", "irecv"])
def test_a_rank_stuck_in_a_point_to_point_operation_stays_stalled_whatever_its_number(op):
    """Point-to-point operations are numbered on their own counter (a pipeline issues many more of them than
    collectives): their number says nothing against the stall record's collectives_entered, and a stage stuck
    in one must stay a waiter (it would never be judged otherwise)."""
    from distdebug.analysis.hang.load import rank_state

    stall = schema.record(schema.STALL, step=2, phase="training", main_stack=[USER], collectives_entered=2)
    info = {"op": op, "seq": 24, "step": 3, "waiting": True, **({"peer": 1} if op != "batch_isend_irecv" else {})}
    st = rank_state(0, steps([1, 1]) + [stall], (SLOT_INSIDE, info), "")
    assert st.status == Status.STALLED and not st.moved_on


def test_a_crash_dump_cut_short_is_placed_by_the_in_flight_record(tmp_path):
    # Rank 0 died by a fatal signal inside all_reduce #3, and the launcher stopped it before its
    # faulthandler dump reached the main thread: the call site comes from the in-flight record.
    site = {"file": "/home/me/train.py", "line": 53, "func": "<module>"}
    for rank in (0, 1):
        write(tmp_path, rank, steps([1, 1]), world=2)
        InflightSlot(layout.inflight_path(tmp_path, rank)).enter(
            {"op": "all_reduce", "seq": 3, "step": 3, "shapes": [[20 * (rank + 1)]], "site": site})
    cut_short = "Fatal Python error: Aborted\n\nThread 0x00007f (most recent call first):\n"
    layout.crash_path(tmp_path, 0).write_text(cut_short)
    write(tmp_path, 1, steps([1, 1]) + [schema.record(schema.SCRIPT_ERROR, step=2, exception="RuntimeError",
                                                      message="size mismatch", collective="all_reduce", stack=[])],
          world=2)
    (f,) = diagnose(load_run(tmp_path))
    assert "rank 0 died by a fatal signal at step 3 in train.py:53 in <module>" in f.message, f.message


def test_clean_run_has_no_hang_finding(tmp_path):
    for rank in range(3):
        write(tmp_path, rank, steps([1, 1, 1]) + [schema.record(schema.END, exit_code=0)])
    assert diagnose(load_run(tmp_path)) == []


def test_init_process_group_that_raised_is_a_startup_failure_not_a_hang(tmp_path):
    init = {"file": "/home/me/train.py", "line": 2, "func": "<module>", "code": 'dist.init_process_group("gloo")'}
    error = "Gloo connectFullMesh failed with [/__w/gloo/pair.cc:152] timed out connecting: Connection refused"
    write(tmp_path, 0, [schema.record(schema.PG_INIT, phase="begin")])  # ended by the launcher inside init
    write(tmp_path, 1, [schema.record(schema.PG_INIT, phase="begin"),
                        schema.record(schema.SCRIPT_ERROR, step=0, exception="RuntimeError", message=error,
                                      collective="_new_process_group_helper", stack=[init])])
    write(tmp_path, 2, [])  # never got as far as init
    [f] = diagnose(load_run(tmp_path))
    assert (f.subject, f.ranks, f.step) == ("init_process_group", [1], None)
    assert f"(RuntimeError: {error})" in f.message
    assert "rank(s) [0] were still in init_process_group" in f.message
    assert "rank(s) [2] left no record of reaching it" in f.message


def test_rank_killed_from_outside_is_named_from_the_launcher_whatever_the_others_wrote(tmp_path):
    # Rank 1 was SIGKILLed in step 3; the launcher stopped ranks 0 and 2 before they failed in
    # their next collective, so no survivor recorded an error: the launcher's first failure says it.
    write(tmp_path, 0, steps([1, 1, 1]))
    write(tmp_path, 1, steps([1, 1]))
    write(tmp_path, 2, steps([1, 1, 1]))
    run = load_run(tmp_path)
    assert diagnose(run) == []  # nothing in the records alone
    (f,) = diagnose(run, first_failure=(1, -9))
    assert (f.ranks, f.step, f.subject) == ([1], 3, "rank 1")
    assert f.message == "rank 1 was killed by SIGKILL during step 3 (no record after step 2); the launcher then " \
                        "stopped rank(s) [0, 2]"
    assert "OOM killer" in f.fix
    assert diagnose(run, first_failure=(1, 1)) == []  # an exit code is the script's own, not a kill
    write(tmp_path, 1, [])  # a rank with an end record was not killed mid-step
    w = EventWriter(layout.events_path(tmp_path, 1))
    w.write(schema.record(schema.END, exit_code=0))
    w.close()
    assert diagnose(load_run(tmp_path), first_failure=(1, -9)) == []


def _stalled(run_dir, rank, counts, inflight=None, world=3):
    write(run_dir, rank, steps(counts) + [schema.record(schema.STALL, step=len(counts), phase="training",
                                                        main_stack=[USER, TORCH] if inflight else [USER])],
          world=world)
    if inflight:
        InflightSlot(layout.inflight_path(run_dir, rank)).enter(inflight)


def test_skipped_collective_names_the_skipper_whichever_rank_was_caught_waiting(tmp_path):
    # Rank 1 skipped its all_reduce in step 3; its later ones paired with rank 0's earlier ones,
    # and here it is rank 1 that was recorded inside the last one while rank 0 was not: the count
    # difference, not the timing of the stall records, decides.
    _stalled(tmp_path, 0, [1, 1, 1, 1])
    _stalled(tmp_path, 1, [1, 1, 0, 1], inflight={"op": "all_reduce", "seq": 5, "step": 5, "shapes": [[8]]})
    (f,) = diagnose(load_run(tmp_path))
    assert (f.ranks, f.step) == ([1], 3)
    assert f.message.startswith("all_reduce #5 (sizes [[8]]") and "never completed" in f.message


def test_extra_collective_is_named_by_the_majority_of_counts(tmp_path):
    # Three ranks: rank 0 made one collective more in step 2 (a rank-0-only all_reduce): the two
    # ranks that agree are not blamed, though they are the ones caught outside a collective.
    _stalled(tmp_path, 0, [1, 2, 1], inflight={"op": "all_reduce", "seq": 5, "step": 4, "shapes": [[8]]})
    _stalled(tmp_path, 1, [1, 1, 1, 1])
    _stalled(tmp_path, 2, [1, 1, 1, 1])
    (f,) = diagnose(load_run(tmp_path))
    assert (f.ranks, f.step) == ([0], 2)


FUNCOL = [{"file": "/x/site-packages/torch/distributed/_functional_collectives.py", "line": 142,
           "func": "wait_tensor", "code": "return torch.ops._c10d_functional.wait_tensor(tensor)"},
          {"file": "/x/site-packages/torch/_ops.py", "line": 1279, "func": "__call__",
           "code": "return self._op(*args)"}]
"""The innermost frames of a rank waiting for a functional collective's result (DTensor's TP all-reduce)."""


def test_a_rank_waiting_for_a_functional_collective_is_a_waiter_not_a_culprit(tmp_path):
    # DDP x TP on 4 ranks: rank 1 blocks in its forward; its TP peer, rank 0, waits for the TP all-reduce's
    # result (wait_tensor: no collective of ours in flight); ranks 2 and 3 wait in DDP's scatter. Only
    # rank 1 is the culprit.
    def stalled(rank, stack, inflight=None):
        write(tmp_path, rank, steps([1, 1]) + [schema.record(schema.STALL, step=2, phase="training",
                                                             main_stack=stack)], world=4)
        if inflight:
            InflightSlot(layout.inflight_path(tmp_path, rank)).enter(inflight)

    stalled(0, [USER, *FUNCOL])
    stalled(1, [USER])
    for r in (2, 3):
        stalled(r, [USER, TORCH], {"op": "scatter", "seq": 1, "step": 3, "shapes": []})
    (f,) = diagnose(load_run(tmp_path))
    assert (f.ranks, f.step, f.subject) == ([1], 3, "scatter #1")
    assert "ranks [0] wait for a functional collective (DTensor, tensor parallelism) to complete" in f.message
    # Only functional waiters (pure tensor parallelism on 2 ranks): the same culprit, said so.
    tp = tmp_path / "tp"
    for rank, stack in ((0, [USER, *FUNCOL]), (1, [USER])):
        write(tp, rank, steps([1, 1]) + [schema.record(schema.STALL, step=2, phase="training", main_stack=stack)],
              world=2)
    (f,) = diagnose(load_run(tp))
    assert (f.ranks, f.step, f.subject) == ([1], 3, "a functional collective (DTensor, tensor parallelism)")
    assert f.message.startswith("ranks [0] wait for a functional collective")
    # Issuing a functional collective, or any other frame of torch, is not waiting for one.
    assert functional_wait([USER, {**FUNCOL[0], "func": "all_reduce"}]) is None
    assert functional_wait([*FUNCOL, USER]) is None
    assert functional_wait(FUNCOL) == {"op": "wait_tensor", "seq": "?", "shapes": None, "functional": True}


def test_collective_shapes_are_read_however_the_collective_was_called():
    import torch

    from distdebug.runtime.callinfo import call_shapes as _call_shapes

    t = torch.zeros(3, 2)
    assert _call_shapes((t,), {}) == [[3, 2]]  # all_reduce(t)
    assert _call_shapes((), {"tensor": t}) == [[3, 2]]
    # all_to_all_single as DeepSpeed calls it, with split sizes
    assert _call_shapes((), {"output": torch.zeros(4), "input": torch.zeros(6), "input_split_sizes": [2, 4]}) == \
        [[4], [6], {"input": [2, 4]}]
    assert _call_shapes(([torch.zeros(1), torch.zeros(2)], t), {}) == [[1], [2], [3, 2]]  # all_gather(list, t)
    assert _call_shapes((t,), {"scatter_list": [t, t]}) == [[3, 2], [3, 2], [3, 2]]
    assert _call_shapes(([None, None], {"a": 1}), {}) is None  # all_gather_object: no tensor
    assert _call_shapes((t, None, True), {}) == [[3, 2]]  # a flag in third place is not a split


def test_a_send_meeting_a_receive_is_not_a_mismatch_and_each_side_names_its_peer(tmp_path):
    # Pipeline stages: rank 0 sends its activations while rank 1 receives them, at the same sequence
    # number; both stalled. Not "ranks disagree on collective #4": each side says whom it waits for.
    import torch

    from distdebug.runtime.callinfo import p2p_peer as _p2p_peer

    assert _p2p_peer("isend", (torch.ones(2), 1), {}) == {"peer": 1, "tag": 0}
    assert _p2p_peer("irecv", (torch.ones(2),), {"src": 0, "tag": 7}) == {"peer": 0, "tag": 7}
    assert _p2p_peer("recv", (torch.ones(2),), {"group_src": 1}) == {"peer": 1, "group_peer": 1, "tag": 0}
    _stalled(tmp_path, 0, [2, 2], {"op": "send", "seq": 5, "step": 3, "shapes": [[8]], "peer": 1, "tag": 0}, world=2)
    _stalled(tmp_path, 1, [2, 2], {"op": "recv", "seq": 5, "step": 3, "shapes": [[4]], "peer": 0, "tag": 3}, world=2)
    findings = diagnose(load_run(tmp_path))
    assert not any(f.subject == "collective #5" for f in findings)
    text = " ".join(f.message for f in findings)
    assert "rank 0 is inside send to rank 1 #5" in text and "rank 1 is inside recv from rank 0 (tag 3) #5" in text


# ---------------------------------------------------------------- the judgement alone: facts in, findings out
GOLDEN_HANG = Path(__file__).resolve().parents[1] / "data" / "golden" / "hang"


@pytest.fixture(scope="module")
def golden_facts() -> HangFacts:
    """The golden hung run (rank 1 sleeps in step 3 while rank 0 waits in all_reduce #13), loaded once."""
    return load_facts(load_run(GOLDEN_HANG / "run"))


def test_the_golden_hang_is_judged_from_its_loaded_facts_alone(golden_facts):
    want = json.loads((GOLDEN_HANG / "expected.json").read_text())
    # What loading found: rank 0 inside the all_reduce, rank 1 stalled outside it, the Flight Recorder's
    # match naming rank 1 missing from the same collective.
    assert golden_facts.world_size == 2 and golden_facts.first_failure is None
    assert (golden_facts.ranks[0].status, golden_facts.ranks[0].inflight_state) == (Status.STALLED, SLOT_INSIDE)
    assert (golden_facts.ranks[1].status, golden_facts.ranks[1].inflight_state) == (Status.STALLED, SLOT_FINISHED)
    assert golden_facts.flight_recorder is not None
    assert (golden_facts.flight_recorder["seq"], golden_facts.flight_recorder["missing_ranks"]) == (13, [1])
    before = copy.deepcopy(golden_facts)
    (f,) = judge(golden_facts)
    assert (f.detector, f.ranks, f.step, f.subject) == (want["detector"], want["ranks"], want["step"], want["subject"])
    for text in want["message_contains"]:
        assert text in f.message, f.message
    assert golden_facts == before and judge(golden_facts) == [f]  # pure: the facts untouched, the same answer
    # Without the Flight Recorder's match, the in-flight slots and the stacks still name rank 1, in the
    # collective of ours rank 0 waits in.
    (g,) = judge(HangFacts(ranks=golden_facts.ranks, world_size=2))
    assert (g.ranks, g.step, g.subject) == ([1], 3, "all_reduce #13")
    assert "ranks [0] wait in all_reduce #13" in g.message and "rank 1 is stuck at step 3 in hang.py" in g.message


def test_the_golden_run_killed_by_the_launcher_is_judged_from_the_facts_as_given(golden_facts):
    # The same facts with the launcher's first failure: rank 1 stalled (not RUNNING), so it is not marked
    # killed, and the verdict stands; the facts given are not marked either.
    (f,) = judge(HangFacts(ranks=golden_facts.ranks, world_size=2,
                           flight_recorder=golden_facts.flight_recorder, first_failure=(1, -9)))
    assert (f.ranks, f.step) == ([1], 3)
    assert all(s.killed_by is None for s in golden_facts.ranks.values())


def _waiting(rank: int, seq: int, op: str = "all_reduce") -> RankState:
    return RankState(rank=rank, status=Status.STALLED, step=4, phase="training", stack=[USER, TORCH],
                     inflight_state=SLOT_INSIDE, inflight={"op": op, "seq": seq, "step": 5, "shapes": [[8]]},
                     step_collectives={1: 2, 2: 2, 3: 2, 4: 2})


def test_facts_built_by_hand_name_the_rank_the_step_and_the_collective():
    # Ranks 0 and 2 wait inside broadcast #9 of step 5; rank 1 stalled in its own code after step 4.
    behind = RankState(rank=1, status=Status.STALLED, step=4, phase="training", stack=[USER],
                       step_collectives={1: 2, 2: 2, 3: 2, 4: 2})
    facts = HangFacts(ranks={0: _waiting(0, 9, "broadcast"), 1: behind, 2: _waiting(2, 9, "broadcast")},
                      world_size=3)
    (f,) = judge(facts)
    assert (f.severity, f.ranks, f.step, f.subject) == (Severity.CRITICAL, [1], 5, "broadcast #9")
    assert f.message.startswith("ranks [0, 2] wait in broadcast #9 (sizes [[8]], called at train.py:40")
    assert "rank 1 is stuck at step 5 in train.py:40 in <module>" in f.message


def test_a_flight_recorder_match_built_by_hand_names_the_missing_rank():
    # NCCL's way: a collective returns once enqueued, so no rank is inside one of ours; only the Flight
    # Recorder's match (rank 1 missing from all_reduce #7) names the culprit.
    idle = [RankState(rank=r, status=Status.STALLED, step=6, stack=[USER], step_collectives={6: 1})
            for r in (0, 1)]
    fr = {"seq": 7, "op": "nccl:all_reduce", "process_group": "0:default_pg", "input_sizes": [[4]],
          "missing_ranks": [1], "mismatch": None, "expected_ranks": [0, 1],
          "frames": [{"file": "/home/me/train.py", "line": 12, "func": "<module>"}]}
    facts = HangFacts(ranks={s.rank: s for s in idle}, world_size=2, flight_recorder=fr)
    (f,) = judge(facts)
    assert (f.ranks, f.step, f.subject) == ([1], 7, "nccl:all_reduce #7")
    assert "ranks [0] wait in nccl:all_reduce #7 (sizes [[4]], group 0:default_pg, called at train.py:12" in f.message
    # The twin without the match: every rank busy in its own work, a warning with no culprit.
    assert is_busy_stall(judge(HangFacts(ranks=facts.ranks, world_size=2)))


def test_a_rank_killed_from_outside_is_judged_from_the_launchers_failure_without_marking_the_facts():
    ran = {r: RankState(rank=r, status=Status.RUNNING, step=2 + (r != 1), step_collectives={1: 1, 2: 1})
           for r in range(3)}
    facts = HangFacts(ranks=ran, world_size=3, first_failure=(1, -9))
    (f,) = judge(facts)
    assert (f.ranks, f.step, f.subject) == ([1], 3, "rank 1") and "killed by SIGKILL" in f.message
    assert facts.ranks[1].killed_by is None  # the facts given are left as they were
    assert judge(HangFacts(ranks=ran, world_size=3)) == []
