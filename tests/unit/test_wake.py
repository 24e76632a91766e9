"""Tier 1: distdebug stacks reaches the ranks through one watcher per node (issue 48, item 5). A rank's pipe
sleeps until woken and costs nothing meanwhile; the node's relay looks at the request file (one stat a
wake-up) and wakes every rank of its node once per new request, never for an old one; a rank that is gone
is skipped; the relay's folder is removed at its end."""

from __future__ import annotations

import os
import time

from distdebug import envvars
from distdebug.artifacts import layout
from distdebug.artifacts.writer import write_json_atomic
from distdebug.launch.relay import StacksRelay
from distdebug.runtime.wake import WakePipe, wake_all


def test_a_pipe_sleeps_until_woken_and_a_gone_rank_is_skipped(tmp_path):
    a, b = WakePipe(tmp_path, 0), WakePipe(tmp_path, 1)
    t = time.monotonic()
    assert not a.wait(0.2) and time.monotonic() - t >= 0.19  # no wake-up: it sleeps its interval
    b.close()  # rank 1 ended: its pipe is gone
    assert wake_all(tmp_path) == 1
    assert a.wait(5) and not a.wait(0.05)  # woken once; what was written is drained
    a.poke()
    assert a.wait(0.05)  # its own stop wakes it too
    a.close()
    assert list(tmp_path.iterdir()) == []


def test_the_relay_wakes_its_ranks_once_per_new_request(tmp_path, monkeypatch):
    monkeypatch.delenv(envvars.WAKE_DIR, raising=False)
    run = tmp_path / "run"
    write_json_atomic(layout.stacks_request_path(run), {"id": "old"})  # a request from before: not relayed
    relay = StacksRelay(run, interval=0.05)
    started = time.monotonic()
    relay.start()
    try:
        folder = relay.folder
        assert folder is not None and os.environ[envvars.WAKE_DIR] == str(folder)
        pipes = [WakePipe(folder, r) for r in range(3)]
        assert not any(p.wait(0.3) for p in pipes)
        time.sleep(0.02)  # a new mtime, even on a file system with coarse timestamps
        write_json_atomic(layout.stacks_request_path(run), {"id": "new"})
        assert all(p.wait(5) for p in pipes)
        assert not any(p.wait(0.3) for p in pipes)  # once per request
        assert relay.relayed == 1
        for p in pipes:
            p.close()
    finally:
        relay.stop()
    elapsed = time.monotonic() - started
    assert not folder.exists()
    # Its cost: one stat of the request file a wake-up for the whole node (three ranks here), not one a rank.
    assert 2 <= relay.stats <= elapsed / 0.05 + 2


def test_a_killed_launchers_folder_goes_with_its_last_orphaned_rank_or_the_next_launcher(tmp_path):
    # A launcher killed by SIGKILL cannot remove its wake-up folder. Its ranks, orphaned, remove their pipes and
    # the last one the empty folder (a rank of a live launcher never does: a restarted rank makes its pipe there
    # again); what is still left, the next launcher on the host sweeps: a folder whose launcher pid is gone. Its
    # clean twins: a live launcher's folder, and anything else in the temporary directory, stay.
    import subprocess

    from distdebug.launch.relay import PREFIX, sweep

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that ran and is gone
    mine = tmp_path / f"{PREFIX}{os.getpid()}-live"
    gone = tmp_path / f"{PREFIX}{dead.pid}-dead"
    other = tmp_path / "distdebug-docs"
    for d in (mine, gone, other):
        d.mkdir()
    os.mkfifo(gone / "rank-00001.wake")  # a rank killed before it could remove its pipe
    assert sweep(tmp_path) == [gone]
    assert mine.exists() and other.exists() and not gone.exists()
    # the rank's side: alive parent, the folder stays; orphaned (its parent pid no longer its parent), it goes
    a, b = WakePipe(mine, 0), WakePipe(mine, 1)
    a.close()
    assert mine.exists()
    b.parent = -1  # as if its launcher had died (the rank re-parented)
    b.close()
    assert not mine.exists()
