"""Tier 1 (pure): how ranks are split for a cross-rank check from each rank's data-parallel group."""

from __future__ import annotations

from distdebug.runtime.layout import Layout, partition


def test_partition_by_the_groups_each_rank_states():
    assert partition({0: None, 1: None, 2: None}) == [[0, 1, 2]]  # plain data parallelism: every rank
    assert partition({0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}) == [[0, 2], [1, 3]]  # DDP x TP
    assert partition({0: False, 1: False}) == []  # TP only, or pipeline stages: nobody to compare with
    assert partition({0: [0, 1], 1: [0, 1], 2: False}) == [[0, 1]]


def test_a_plain_layout_compares_every_rank_and_says_so():
    lay = Layout(rank=1, world=4)
    assert lay.data_group() is None and lay.replicas(object()) is None
    assert lay.label() == "data parallel over 4 ranks"
    assert lay.describe()["data_parallel_group"] == [0, 1, 2, 3]
    alone = Layout(rank=1, world=4, dp=[1])
    assert alone.data_group() is False and alone.describe()["data_parallel_group"] == [1]
    assert Layout(rank=2, world=4, dp=[0, 2]).data_group() == [0, 2]
