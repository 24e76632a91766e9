"""Tier 2 (real gloo ranks, forked): one cross-rank exchange per rank, shared by every detector.

Counted on live ranks: the harness's process groups (by their group description) and its threads,
with every exchanging detector on, during the training and after the script destroys its group.
Also: posts are matched across ranks by tag and count, so one detector whose posts differ on one
rank never mis-pairs, and the other detectors' exchanges go on.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distdebug.detectors.bn_divergence import BatchNormDivergence
from distdebug.detectors.data_order import DataOrder
from distdebug.detectors.init_seed import InitSeed
from distdebug.detectors.loss_spike import LossSpike
from distdebug.detectors.replica_divergence import ReplicaDivergence
from distdebug.detectors.straggler import Straggler
from distdebug.runtime.exchange import HARNESS_GROUP_DESC, THREAD_NAME, Exchange
from tests.dist.test_replica_divergence import findings
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks


def _harness_groups() -> int:
    world = dist.distributed_c10d._world
    return sum(1 for pg in world.pg_map if getattr(pg, "group_desc", "") == HARNESS_GROUP_DESC)


def _our_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("distdebug"))


def _all_detectors(rank, world, tmp):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dets = [LossSpike(), Straggler(), BatchNormDivergence(), DataOrder(), InitSeed(), ReplicaDivergence()]
    s = start_session(tmp, rank, detectors=dets)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    during = None
    for step in range(1, 21):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 10:
            during = (_harness_groups(), _our_threads())
    dist.destroy_process_group()
    after = _our_threads()
    s.close(0)
    return during, after, [d.name for d in s.detectors]


def test_one_group_and_one_thread_per_rank_for_every_detector(tmp_path):
    results = spawn_ranks(_all_detectors, 3, timeout=120, tmp=tmp_path)
    for rank, (during, after, running) in enumerate(results):
        assert during == (1, [THREAD_NAME]), (rank, during)
        assert after == [], (rank, after)  # drained and closed when the script destroyed its group
        assert len(running) == 6, (rank, running)  # no detector was switched off
    for rank in range(3):  # the exchange never stopped or failed
        assert [f for f in findings(tmp_path, rank) if f["detector"] == "harness"] == [], rank


def _one_detector_out_of_step(rank, world, tmp):
    """Rank 1 posts one exchange more under tag 'a' (its step numbers parted): 'b' must go on intact."""
    from distdebug.artifacts import layout
    from distdebug.artifacts.writer import EventWriter
    from distdebug.findings import Finding

    writer = EventWriter(layout.events_path(tmp, rank))
    got: list[tuple[str, list]] = []

    def report(f: Finding) -> None:
        writer.write({"kind": "finding", **f.to_dict()})

    ex = Exchange(rank, report, {})
    a, b = ex.channel("a"), ex.channel("b")
    a.post(rank, lambda g: got.append(("a", g)))
    if rank == 1:
        a.post(rank, lambda g: got.append(("a", g)))  # only here: never matched, never mis-paired
    b.post(rank * 10, lambda g: got.append(("b", g)))
    b.post(rank * 10 + 1, lambda g: got.append(("b", g)))
    ex.close(clean=True)
    writer.close()
    return got, ex.group is None


def test_posts_are_matched_by_tag_and_count_so_one_detector_out_of_step_spoils_no_other(tmp_path):
    results = spawn_ranks(_one_detector_out_of_step, 2, timeout=60, tmp=tmp_path)
    for got, released in results:
        # Every rank ran the same callbacks with the same payloads; rank 1's extra 'a' paired with nothing.
        assert sorted(got) == [("a", [0, 1]), ("b", [0, 10]), ("b", [1, 11])], got
        assert released  # the clean close drained and released the group
    for rank in range(2):
        assert findings(tmp_path, rank) == []


def _posts_at_different_moments(rank, world, tmp):
    """Within one boundary rank 1 posts 'b' a second after 'a' (a slow detector); rank 0 posts both at
    once. The flush makes each rank's round hold the boundary's posts: both complete during the run."""
    import time

    from distdebug.findings import Finding

    got: list[str] = []

    def report(f: Finding) -> None:
        got.append(f"finding: {f.message}")

    ex = Exchange(rank, report, {})
    a, b = ex.channel("a"), ex.channel("b")
    a.post(rank, lambda g: got.append("a"))
    if rank == 1:
        time.sleep(1.0)
    b.post(rank, lambda g: got.append("b"))
    ex.flush()
    time.sleep(3.0 - (1.0 if rank == 1 else 0.0))
    seen_before_close = list(got)
    ex.close(clean=True)
    return seen_before_close


def test_one_round_per_flush_holds_the_boundarys_posts_made_at_different_moments(tmp_path):
    for seen in spawn_ranks(_posts_at_different_moments, 2, timeout=60, tmp=tmp_path):
        assert sorted(seen) == ["a", "b"], seen


def _unclean_end_starts_no_round(rank, world, tmp):
    """Rank 1 posts without a flush and ends uncleanly (the script raised): its thread must leave at
    once, in no collective (one in flight at interpreter exit makes gloo abort the process)."""
    import time

    ex = Exchange(rank, lambda f: None, {})
    if rank == 1:
        ex.channel("a").post(1, lambda g: None)
        t0 = time.monotonic()
        ex.close(clean=False)
        return time.monotonic() - t0, ex.group is None
    time.sleep(3.0)  # rank 0 never joins
    ex.close(clean=False)
    return 0.0, ex.group is None


@pytest.mark.alone  # asserts on a measured time: nothing runs beside it
def test_an_unclean_end_leaves_at_once_and_releases_the_group(tmp_path):
    (_, _), (took, released) = spawn_ranks(_unclean_end_starts_no_round, 2, timeout=60, tmp=tmp_path)
    assert took < 1.0 and released  # the thread left without a round, so the group was destroyed
