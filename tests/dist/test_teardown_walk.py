"""Tier 2 (real gloo ranks, forked): the walk at a rank's end that frees destroyed process groups held as
module globals and function defaults (runtime.teardown), made cheap (0.5 s a rank to 0.1 on the main recipe:
the functions of modules imported before the first group are not walked, nor a module's twice) and still
finding each way a group is held: a global of a module imported before the first group (DeepSpeed's
_WORLD_GROUP), a default of a function imported after it (torch.distributed.nn.functional's), and a default
whose group was still registered at the first walk and destroyed before the second (the walk's cache)."""

from __future__ import annotations

import sys
import types

import torch.distributed as dist

from distdebug.runtime import teardown
from tests.helpers import spawn_ranks


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    return mod


def _holds(rank: int, world: int) -> dict:
    before = _module("dd_test_before")  # imported before the first group: its functions are never walked
    teardown._before_groups, teardown._walked = set(sys.modules), {}
    first = dist.new_group([0, 1])
    after = _module("dd_test_after")
    exec("def collective(x, group=G):\n    return group\n", {"G": first}, after.__dict__)
    after.collective.__module__ = after.__name__
    before.CACHED_GROUP = first  # a global set later, as deepspeed.utils.groups._WORLD_GROUP is
    second = dist.new_group([0, 1])
    later = _module("dd_test_later")
    exec("def collective(x, *, group=G):\n    return group\n", {"G": second}, later.__dict__)
    later.collective.__module__ = later.__name__
    dist.destroy_process_group(first)
    released_first = teardown.release_stale_defaults()  # `second` is still registered: left where it is
    kept = later.collective.__kwdefaults__["group"] is second
    dist.destroy_process_group(second)
    released_second = teardown.release_stale_defaults()  # found again from the cache of the first walk
    return {"first": sorted(released_first), "kept": kept, "second": sorted(released_second),
            "global": before.CACHED_GROUP, "default": after.collective.__defaults__,
            "kwdefault": later.collective.__kwdefaults__, "walked_before": teardown._walked["dd_test_before"][1]}


def test_each_way_a_destroyed_group_is_held_is_released_and_a_registered_one_is_kept():
    for got in spawn_ranks(_holds, world=2):
        assert got["first"] == ["dd_test_after.collective", "dd_test_before.CACHED_GROUP"]
        assert got["kept"] and got["second"] == ["dd_test_later.collective"]
        assert got["global"] is None and got["default"] == (None,) and got["kwdefault"] == {"group": None}
        assert got["walked_before"] == []
