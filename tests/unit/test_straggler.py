"""Tier 1 (pure): straggler scores from per-rank arrival times on synthetic rows."""

from __future__ import annotations

import random

from distdebug.detectors.straggler import MIN_STEPS, by_position, host_floor, scores, verdicts


def rows(world, steps=20, slow=None, late=0.0, data_late=False, offset=None, seed=0, synced=False):
    """[step, step_time, boundary_t, forward_t, backward_t, data_s] per rank: 10 ms steps, 4 ms forward.
    ``synced``: a collective between loading and forward (every rank leaves it when the last arrives)."""
    rng = random.Random(seed)
    out = {r: [] for r in range(world)}
    t = 100.0
    for s in range(2, steps + 2):
        step = 0.010 + late
        for r in range(world):
            jitter = rng.uniform(0, 0.0003)
            extra = late if r == slow else 0.0
            data = 0.0002 + (extra if data_late else 0.0)
            fwd = t + data + (0.0 if data_late else extra) + jitter  # arrives after its data and its extra work
            if synced:  # everyone waits for the slowest loader in a collective before the forward
                fwd = t + 0.0002 + (late if data_late and slow is not None else 0.0) + jitter
            bwd = fwd + 0.004
            shift = (offset or {}).get(r, 0.0)  # another node's clock
            out[r].append([s, step, t + step + shift, fwd + shift, bwd + shift, data])
        t += step
    return out


def test_no_straggler_in_noise_and_too_few_steps():
    for seed in range(10):
        table = scores(rows(4, seed=seed))
        assert verdicts(table) == [] and all(row["score"] > 0.9 for row in table.values())
    assert scores(rows(2, steps=MIN_STEPS - 1)) == {}


def test_a_rank_late_at_every_step_is_named_with_its_cause():
    table = scores(rows(3, slow=2, late=0.020))
    ((rank, cause, row),) = verdicts(table)
    assert (rank, cause) == (2, "compute")
    assert abs(row["lateness_s"] - 0.020) < 0.001 and row["score"] < 0.5 and table[0]["score"] > 0.9
    ((rank, cause, _),) = verdicts(scores(rows(3, slow=1, late=0.020, data_late=True)))
    assert (rank, cause) == (1, "data")


def test_clocks_of_other_nodes_are_aligned_by_the_step_boundaries():
    ((rank, cause, _),) = verdicts(scores(rows(4, slow=3, late=0.02, offset={2: 5.0, 3: -7.5})))
    assert (rank, cause) == (3, "compute")
    assert verdicts(scores(rows(4, offset={1: 12.0}))) == []


def with_device(per_rank, forward_s):
    """The same rows with a device forward time per rank (s): what CUDA events measure."""
    return {r: [row + [forward_s[r]] for row in rs] for r, rs in per_rank.items()}


def test_a_slow_device_is_seen_where_host_times_cannot_see_it():
    # The CPU ran ahead of the devices: host arrival times are the same on every rank (no slow rank in
    # them), but rank 1's forward took 12 ms on its device against 4 ms elsewhere.
    host = rows(3, seed=1)
    assert verdicts(scores(host)) == []
    table = scores(with_device(host, {0: 0.004, 1: 0.012, 2: 0.004}))
    assert {row["clock"] for row in table.values()} == {"device"}
    ((rank, cause, row),) = verdicts(table)
    assert (rank, cause) == (1, "compute") and abs(row["lateness_s"] - 0.008) < 1e-9 and row["score"] < 0.4
    # Equal device times: nobody; host rows without device times keep the host clock.
    assert verdicts(scores(with_device(host, {0: 0.004, 1: 0.004, 2: 0.004}))) == []
    assert {row["clock"] for row in scores(rows(3, slow=2, late=0.02)).values()} == {"host"}


class FakeClock:
    """An injected event source: marks are fake device times; settle counts the host waits."""

    def __init__(self):
        self.now = 0.0
        self.settled = 0

    def mark(self):
        return self.now

    def settle(self, token):
        self.settled += 1

    def elapsed(self, start, end):
        return end - start


class FakeChannel:
    def __init__(self):
        self.posts = []

    def post(self, payload, callback, prepare=None):
        self.posts.append(payload)
        return True


def test_device_times_are_marked_in_the_forward_and_resolved_only_at_checked_steps():
    from distdebug.context import RankContext, RankIdentity, StepEvent
    from distdebug.detectors.straggler import DEVICE, Straggler

    clock = FakeClock()
    det = Straggler(clock=clock)
    det.ctx = RankContext(RankIdentity(rank=0, local_rank=0, world_size=2, local_world_size=2, node=0, attempt=0,
                                       host="h", pid=1), None, None)
    det.exchange = FakeChannel()
    for step in range(1, 17):
        det._device_start(None, ())
        clock.now += 0.005 * step  # this step's forward on the device
        det._device_end(None, (), None)
        det._device_start(None, ())  # a second forward in the same step (accumulation): not the first
        det.on_step(StepEvent(rank=0, step=step, loss=1.0, step_time_s=0.01, backward_calls=1, collectives=0))
    # Checked steps 2, 4, 8 and 16 posted; each resolved its rows with one wait, never inside a hook.
    assert clock.settled == 4 == len(det.exchange.posts)
    assert {stage for stage, _ in det.exchange.posts} == {None}  # no pipeline: every rank is compared
    posted = [row for _, rows in det.exchange.posts for row in rows]
    assert [int(r[0]) for r in posted] == list(range(2, 17))
    assert all(abs(r[DEVICE] - 0.005 * r[0]) < 1e-12 for r in posted)


def test_pipeline_stages_are_compared_only_with_the_same_stage():
    # 2 pipelines x 2 stages: stage 1 (ranks 1, 3) starts its forward 15 ms after stage 0 by design
    # (it waits for the activations). Compared with every rank, both stage-1 ranks look late; compared
    # by stage, nobody is. A rank of stage 0 that really is late is still named.
    def staged(**kw):
        out = rows(4, **kw)
        for r in (1, 3):
            for row in out[r]:
                row[3] += 0.015
                row[4] += 0.015
        return out

    stages = {0: 0, 1: 1, 2: 0, 3: 1}
    assert {rank for rank, _, _ in verdicts(scores(staged()))} == {1, 3}  # the false alarm, without stages
    table, found = by_position(staged(), stages)
    assert found == [] and set(table) == {0, 1, 2, 3}
    ((rank, cause, _),) = by_position(staged(slow=2, late=0.020), stages)[1]
    assert (rank, cause) == (2, "compute")
    # a single pipeline: no rank shares a stage, nothing is compared
    assert by_position(rows(2, slow=1, late=0.020), {0: 0, 1: 1}) == ({}, [])
    assert by_position(rows(2, slow=1, late=0.020), {0: None, 1: None})[1][0][0] == 1


def test_the_host_floor_grows_where_ranks_share_cores():
    # 4 CPU-bound ranks on 2 cores: each waits for a core a timeslice per sharer, every step; a rank
    # 15 ms late per 36 ms step there is noise, while a 50 ms sleep in every forward is still a straggler.
    assert (host_floor(2, 2), host_floor(4, 2), host_floor(3, 2), host_floor(8, 64)) == (0.010, 0.020, 0.020, 0.010)
    noisy = rows(4, slow=1, late=0.015)
    assert [r for r, _, _ in verdicts(scores(noisy))] == [1]
    assert verdicts(scores(noisy), host_floor(4, 2)) == []
    assert [r for r, _, _ in verdicts(scores(rows(4, slow=1, late=0.050)), host_floor(4, 2))] == [1]


def test_a_slow_loader_hidden_by_a_collective_before_the_forward_is_still_named():
    """Issue 22 (the HF Trainer gathers each batch's token count between loading and forward): the other
    ranks wait for the slow loader inside that collective, so every rank arrives at the forward together;
    the slow rank's extra time in its data loader still names it. Noise alone names nobody."""
    table = scores(rows(3, slow=1, late=0.020, data_late=True, synced=True))
    assert all(row["lateness_s"] < 0.001 for row in table.values())  # arrival times cannot tell
    ((rank, cause, row),) = verdicts(table)
    assert (rank, cause) == (1, "data-sync") and row["data_wait_s"] > 0.02
    for seed in range(10):
        assert verdicts(scores(rows(4, seed=seed, synced=True))) == []
    # a little more time in the loader than the others, under a fifth of the step: not a straggler
    assert verdicts(scores(rows(3, slow=1, late=0.001, data_late=True, synced=True))) == []


def test_ranks_spread_by_sharing_cores_are_not_stragglers_but_one_that_stands_out_is():
    """4 ranks on 2 cores: the OS's scheduling makes healthy ranks late by up to half a step, some more than
    others (a clean run named a rank at score 0.60 while its peers had 0.68, 0.73 and 1.0). A straggler stands
    out from its peers' median score, not only from the fastest."""
    rng = random.Random(3)
    per_rank = {r: [] for r in range(4)}
    t = 100.0
    late = {1: 0.0, 0: 0.015, 2: 0.0193, 3: 0.027}  # the clean run's arrival order: rank 1 first, rank 3 last
    for s in range(2, 22):
        step = 0.068
        for r in range(4):
            fwd = t + late[r] + rng.uniform(0, 0.001)
            per_rank[r].append([s, step, t + step, fwd, fwd + 0.02, 0.0])
        t += step
    table = scores(per_rank)
    assert table[3]["score"] < 0.65 and table[3]["lateness_s"] > 0.02  # what the score alone named
    assert 0.65 < table[0]["score"] < 0.8 and 0.62 < table[2]["score"] < 0.75 and table[1]["score"] == 1.0
    assert verdicts(table, floor_s=0.02) == []
    slow = rows(4, slow=2, late=0.050)  # one rank 50 ms late every step among 4: named
    ((rank, cause, _),) = verdicts(scores(slow), floor_s=0.02)
    assert (rank, cause) == (2, "compute")
