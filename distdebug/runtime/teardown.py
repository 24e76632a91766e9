"""A clean end of a rank: no process group, and so no gloo or NCCL thread, left for interpreter teardown.

Why: a process group that is still alive when the interpreter finalises is destroyed there (or
never), with its worker threads still running; a thread that then needs the GIL or a C++ static
that is already gone aborts the process after the script has finished: "terminate called without
an active exception", exit -6 (pytorch/pytorch#179291). ``destroy_process_group()`` alone does not
prevent it: a function whose default argument is ``group=dist.group.WORLD`` evaluates it when its
module is imported, so a module imported *after* ``init_process_group`` holds the default group
for the life of the process. ``torch.distributed.nn.functional`` does exactly this (ten collectives),
and ``torch._dynamo`` imports it, which the first ``optimizer.step()`` does: every ordinary training
loop keeps its default group, and two gloo threads, alive past ``destroy_process_group()``.

``release_stale_defaults`` replaces such defaults that hold a group no longer registered with
``None``, which means the same thing to every torch collective (the default group) and lets the
destroyed group be freed now, on the training thread, while the interpreter is whole. Module
globals that cache a destroyed group (DeepSpeed's ``deepspeed.utils.groups._WORLD_GROUP``) get the
same treatment: None is their "not created yet". Objects the script left in reference cycles
(an FSDP2 module's state holds its mesh, and so its group) are freed by a garbage collection at
the rank's end, after the script returned.
``alive`` lists what would still meet interpreter teardown, for the end record and the advice.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import types
import warnings
from typing import Any


def _registered_groups() -> set[int] | None:
    """ids of the process groups torch still knows (None: torch.distributed is not in use)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return None
    try:
        return {id(pg) for pg in c10d._world.pg_map}
    except Exception:
        return None


def _functions(module: types.ModuleType):
    """Module-level functions and the methods of classes defined in the module."""
    try:
        values = list(vars(module).values())
    except Exception:
        return
    for value in values:
        if isinstance(value, types.FunctionType):
            yield value
        elif isinstance(value, type) and getattr(value, "__module__", None) == module.__name__:
            try:
                members = list(vars(value).values())
            except Exception:
                continue
            for member in members:
                func = getattr(member, "__func__", member)  # staticmethod / classmethod
                if isinstance(func, types.FunctionType):
                    yield func


def release_stale_defaults() -> list[str]:
    """Replace default arguments and module globals that hold a destroyed process group with None;
    returns their names.

    Runs after the script destroyed its groups (``destroy_process_group()``) and at the rank's end.
    A group torch still has registered is left where it is.
    """
    registered = _registered_groups()
    if registered is None:
        return []
    with warnings.catch_warnings():  # module attributes that warn when touched (torch's deprecated aliases)
        warnings.simplefilter("ignore")
        return _release(registered)


def _release(registered: set[int]) -> list[str]:
    dist = sys.modules.get("torch.distributed")
    pg_type = getattr(dist, "ProcessGroup", None) if dist is not None else None
    if pg_type is None:
        return []
    # Whether a type is a process group, worked out once per type: the walk below meets a few hundred
    # thousand values (every module's globals and defaults), and ProcessGroup's isinstance goes through
    # torch's opaque-type metaclass (most of a second a rank, at every destroy_process_group and end).
    kinds: dict[type, bool] = {}

    def stale(value: Any) -> bool:
        t = type(value)
        group = kinds.get(t)
        if group is None:
            group = kinds[t] = issubclass(t, pg_type)
        return group and id(value) not in registered

    released: list[str] = []
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        try:
            names = [k for k, v in list(vars(module).items()) if stale(v)]
        except Exception:
            names = []
        for name in names:  # e.g. deepspeed.utils.groups._WORLD_GROUP: None is its "not created yet"
            try:
                setattr(module, name, None)
                released.append(f"{module.__name__}.{name}")
            except Exception:
                pass
        for func in _functions(module):
            defaults = func.__defaults__
            if defaults and any(stale(d) for d in defaults):
                func.__defaults__ = tuple(None if stale(d) else d for d in defaults)
                released.append(f"{func.__module__}.{func.__qualname__}")
            kw = func.__kwdefaults__
            if kw and any(stale(v) for v in kw.values()):
                func.__kwdefaults__ = {k: None if stale(v) else v for k, v in kw.items()}
                released.append(f"{func.__module__}.{func.__qualname__}")
    return released


def native_threads() -> list[str]:
    """Names of this process's native threads (gloo's ``pt_gloo_runloop``...), Linux /proc; [] elsewhere.

    Threads that carry the process's own name (Python's threads, unnamed ones) are left out: the
    Python threads are listed by name elsewhere.
    """
    me = os.getpid()
    try:
        tids = os.listdir(f"/proc/{me}/task")
        with open(f"/proc/{me}/comm") as f:
            own = f.read().strip()
    except OSError:
        return []
    names = []
    for tid in tids:
        try:
            with open(f"/proc/{me}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if int(tid) != me and name != own:
            names.append(name)
    return sorted(names)


def alive() -> dict[str, Any]:
    """What is still alive at the end of the script: registered process groups, threads."""
    groups = _registered_groups()
    return {
        "process_groups": len(groups) if groups is not None else 0,
        "python_threads": sorted(t.name for t in threading.enumerate()
                                 if t is not threading.main_thread() and t.is_alive()),
        "native_threads": native_threads(),
    }


def release_quietly() -> list[str]:
    """``release_stale_defaults``, which never raises: a clean teardown is a courtesy, never the script's
    failure."""
    try:
        return release_stale_defaults()
    except Exception:
        return []


def end_of_rank(collect: bool) -> dict[str, Any]:
    """The rank's last tidying, after the script: ``collect`` (the script returned) frees what it built and
    left in reference cycles (models whose FSDP/DeepSpeed state holds process groups) now, on this thread,
    rather than in interpreter teardown; returns what is still alive (``alive``; {} if that fails)."""
    try:
        if collect:
            gc.collect()
        return alive()
    except Exception:
        return {}
