"""Tier 1 (pure): distdebug stacks' grouping and wording, on answers as the ranks' watchdogs write them."""

from __future__ import annotations

import os

from distdebug.analysis.stacks import RankAnswer, group, headline, native_dumps, script_frames, summary
from distdebug.findings import ranks_text

TORCH = os.sep.join(["", "venv", "site-packages", "torch", "distributed"])
OURS = os.sep.join(["", "src", "distdebug", "runtime", "patches.py"])


def frame(file, line, func, code=""):
    return {"file": file, "line": line, "func": func, "code": code}


BOOT = [frame("<frozen runpy>", 198, "_run_module_as_main"), frame(OURS, 202, "main"),
        frame("<frozen runpy>", 88, "_run_code")]
WAIT = [*BOOT, frame("/job/train.py", 212, "<module>", "dist.all_reduce(g)"), frame(OURS, 443, "collective"),
        frame(f"{TORCH}{os.sep}c10d_logger.py", 83, "wrapper"),
        frame(f"{TORCH}{os.sep}distributed_c10d.py", 3252, "all_reduce", "work.wait()"), frame(OURS, 186, "wait")]
LOAD = [*BOOT, frame("/job/train.py", 200, "<module>", "batch = next(it)"),
        frame(os.sep.join(["", "venv", "site-packages", "torch", "utils", "data", "dataloader.py"]), 733, "__next__")]


def answer(rank, frames, **extra):
    return RankAnswer(rank, {"rank": rank, "pid": 100 + rank, "host": "h", "step": 3, "phase": "training",
                             "threads": [{"name": "MainThread", "main": True, "frames": frames}], **extra})


def test_ranks_with_the_same_stack_are_one_group_named_by_the_call_and_the_scripts_line():
    answers = {r: answer(r, LOAD if r == 7 else WAIT) for r in range(16)}
    groups = group(answers)
    assert [g.ranks for g in groups] == [[0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15], [7]]
    assert headline(groups) == ("ranks 0-6, 8-15: in all_reduce (torch.distributed) at train.py:212 in <module> "
                                "`dist.all_reduce(g)` | rank 7: in __next__ (torch) at train.py:200 in <module> "
                                "`batch = next(it)`")


def test_distdebugs_own_frames_neither_split_a_group_nor_show():
    # the same script line through distdebug's wrappers at other lines (another version, another path) is one stack
    other = [dict(f, line=f["line"] + 1) if f["file"] == OURS else f for f in WAIT]
    assert len(group({0: answer(0, WAIT), 1: answer(1, other)})) == 1
    shown = script_frames(WAIT)
    assert shown[0]["file"] == "/job/train.py" and all("distdebug" not in f["file"] for f in shown)
    assert summary([]) == "no Python frame (between calls, or starting up)"
    assert summary([*BOOT, frame("/job/train.py", 9, "<module>", "time.sleep(60)")]) == (
        "at train.py:9 in <module> `time.sleep(60)`")


def test_ranks_text_compresses_runs():
    assert ranks_text([3]) == "rank 3" and ranks_text([]) == "rank ?"
    assert ranks_text([0, 2]) == "ranks 0, 2"
    assert ranks_text([5, 0, 1, 2, 9, 10]) == "ranks 0-2, 5, 9-10"


def test_without_py_spy_the_native_frames_are_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy on it
    dumps, note = native_dumps({0: answer(0, WAIT)})
    assert dumps == {} and note is not None
    assert note.startswith("native frames: py-spy is not installed (pip install 'distdebug[native]'")
