"""Tier 1: the parts of a step that once left the interpreter's collector one object a tensor, or a container a
step kept for dozens of steps, leave none (issue 62; the whole harness: tests/dist/test_gc_promotions.py).

A tracked object that outlives two young collections is promoted, and promotions bring on full collections,
which walk everything the process holds (0.12 s a time on the 1,000-tensor bench model). Each test makes the
part work as in a long run and counts what is still tracked after a full collection (which stops tracking
tuples of plain values, as the collector does in a real run).
"""

from __future__ import annotations

import gc
import math

import torch


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_fingerprints_of_new_tensors_at_new_addresses_keep_nothing_a_tensor():
    # Gradients are new tensors at new addresses every step: their byte views were cached by address (up to
    # 8,192 of them, then dropped), so a long run kept and promoted some every step.
    from distdebug.fingerprint.hashing import fast_cpu_fingerprint
    from distdebug.fingerprint.many import fast_cpu_fingerprints

    alive = []  # the last lists stay alive, so the allocator hands out new addresses
    fps = None
    for i in range(4):  # warm: the seeds' caches fill once
        alive = [*alive[-2:], [torch.full((4, 4), float(i)) for _ in range(300)]]
        fast_cpu_fingerprints(alive[-1])
    before = _tracked()
    for i in range(40):
        alive = [*alive[-2:], [torch.full((4, 4), float(i)) for _ in range(300)]]
        fps = fast_cpu_fingerprints(alive[-1])
    alive = []
    grown = _tracked() - before
    assert grown < 30, grown  # 12,000 tensors hashed; a view kept a tensor would be thousands
    t = torch.full((4, 4), 39.0)
    assert fps is not None and fps[0] == fast_cpu_fingerprint(t)  # the same value as one hashed alone


def test_the_same_list_hashed_again_reuses_its_views_and_agrees():
    from distdebug.fingerprint.hashing import fast_cpu_fingerprint
    from distdebug.fingerprint.many import fast_cpu_fingerprints

    params = [torch.randn(3, 5), torch.randn(7), torch.empty(0), torch.randn(2, 2, dtype=torch.float64)]
    alone = [fast_cpu_fingerprint(p) for p in params]
    assert fast_cpu_fingerprints(params) == alone  # first: fresh views, no kept ones
    assert fast_cpu_fingerprints(params) == alone  # second: its views made and kept
    assert fast_cpu_fingerprints(params) == alone  # third: the kept views
    with torch.no_grad():
        params[0].add_(1.0)  # in place: the same address, new bytes
    assert fast_cpu_fingerprints(params)[0] == fast_cpu_fingerprint(params[0]) != alone[0]
    params[1] = torch.randn(7)  # another tensor in the list: its plan is not reused
    assert fast_cpu_fingerprints(params)[1] == fast_cpu_fingerprint(params[1])
    reshaped = [params[0].reshape(5, 3)]  # the same bytes, another shape: another seed
    assert fast_cpu_fingerprints(reshaped) == [fast_cpu_fingerprint(reshaped[0])] != [alone[0]]


def test_the_digests_recent_records_are_not_the_collectors_to_walk():
    from distdebug import strictjson
    from distdebug.artifacts.digest import RECENT, Digest

    d = Digest()
    for step in range(1, 3 * RECENT):
        r = {"v": 1, "kind": "step", "rank": 0, "step": step, "loss": 1.0 / step, "step_time_s": 0.01,
             "collectives": 2, "readout": {"a": [1, 2]}}
        d.feed(r, strictjson.dumps(r))
    gc.collect()
    assert len(d.recent) == RECENT and not any(gc.is_tracked(e) for e in d.recent)
    seq, last = d.recent_records()[-1]
    assert seq == 3 * RECENT - 2 and last["step"] == 3 * RECENT - 1 and last["readout"] == {"a": [1, 2]}
    again = Digest.from_json(strictjson.loads(d.dumps()))  # the index file's round trip
    assert again.recent_records() == d.recent_records()
    nan = {"v": 1, "kind": "step", "rank": 0, "step": 999, "loss": float("nan"), "step_time_s": 0.01}
    d.feed(nan, strictjson.dumps(nan))
    assert math.isnan(d.recent_records()[-1][1]["loss"])  # read back as written: NaN stays a number


def test_data_order_keeps_a_bounded_history_and_still_judges_it():
    from collections import deque

    from distdebug.detectors.data_order import HISTORY, identical_batches

    per_rank = {r: deque(maxlen=HISTORY) for r in range(2)}
    for step in range(1, 10 * HISTORY):
        for r in range(2):
            per_rank[r].append((step, 1000 * step + (r if step < 5 else 0), 0.5))  # sharded until step 5
    full, same = identical_batches(per_rank)
    assert len(full) == HISTORY and same == full  # the newest HISTORY steps, all the same batch
    gc.collect()
    assert not any(gc.is_tracked(rec) for rec in per_rank[0])
