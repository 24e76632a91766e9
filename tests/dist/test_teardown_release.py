"""Tier 2 (a real gloo group): a destroyed group held in a function's default is released, in a module imported
after the session noted the modules of its start (those are not walked for defaults: none can hold a group made
after them), and in every module where a group already existed when the session started."""

from __future__ import annotations

from tests.helpers import free_port, spawn_ranks


def _released(rank, world, before_groups):
    import os
    import sys
    import types

    import torch.distributed as dist

    from distdebug.runtime import teardown

    teardown._before_groups.clear()
    if before_groups:  # the session starts before the script makes its group (attach's case)
        dist.destroy_process_group()
        teardown.note_modules_before_groups()
        noted = "torch.distributed.distributed_c10d" in teardown._before_groups
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    else:  # the session starts inside a script whose group exists: every module is walked
        teardown.note_modules_before_groups()
        noted = bool(teardown._before_groups)
    late = types.ModuleType("late_collectives")  # a module imported once the group exists (as torch's
    exec("import torch.distributed as dist\n"     # distributed.nn.functional is, by the first optimizer step)
         "def all_reduce(t, group=dist.group.WORLD):\n    return t\n", late.__dict__)
    sys.modules[late.__name__] = late
    try:
        dist.destroy_process_group()
        released = teardown.release_stale_defaults()
        return noted, "late_collectives.all_reduce" in released, late.all_reduce.__defaults__ == (None,)
    finally:
        del sys.modules[late.__name__]
        teardown._before_groups.clear()


def test_a_destroyed_group_in_a_later_modules_default_is_released_whenever_the_session_started():
    assert spawn_ranks(_released, 1, before_groups=True) == [(True, True, True)]
    assert spawn_ranks(_released, 1, before_groups=False) == [(False, True, True)]
