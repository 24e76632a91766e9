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
