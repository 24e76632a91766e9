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
from itertools import chain
from operator import attrgetter
from typing import Any

_DEFAULTS = attrgetter("__defaults__")
_KWDEFAULTS = attrgetter("__kwdefaults__")


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


_before_groups: set[str] | None = None
"""The modules imported before the first process group was made (``note_first_group``): a function's default
is evaluated when its module runs, so none of theirs can hold a group, and the walk skips their functions."""
_walked: dict[str, tuple[int, list[types.FunctionType]]] = {}
"""Module name -> (id of the module walked, its functions that had a process group among their defaults): the
walk runs twice a rank's end (at destroy_process_group and at the session's close), and a function's defaults
do not change, so the second looks again only at those (a group registered at the first walk may be destroyed
at the second)."""


def note_first_group() -> None:
    """Called as the first process group is being made (attach's init_process_group): which modules came before.
    Cut the walk at a rank's end from about 0.25 s to a fraction on a training that imported torch first."""
    global _before_groups
    if _before_groups is None:
        _before_groups = set(sys.modules)


def _release(registered: set[int]) -> list[str]:
    dist = sys.modules.get("torch.distributed")
    pg_type = getattr(dist, "ProcessGroup", None) if dist is not None else None
    if pg_type is None:
        return []
    # Whether a type is a process group, worked out once per type: the walk below meets a few hundred
    # thousand values (every module's globals and defaults), and ProcessGroup's isinstance goes through
    # torch's opaque-type metaclass (most of a second a rank, at every destroy_process_group and end).
    kinds: dict[type, bool] = {}

    def group_type(t: type) -> bool:
        group = kinds.get(t)
        if group is None:
            group = kinds[t] = issubclass(t, pg_type)
        return group

    def is_group(value: Any) -> bool:
        return group_type(type(value))

    def stale(value: Any) -> bool:
        return is_group(value) and id(value) not in registered

    released: list[str] = []
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        try:
            values = vars(module)
            # the types of its globals, gathered in C: a module's globals are looked at one by one only where
            # one of them is a process group (a few modules of thousands)
            names = ([k for k, v in list(values.items()) if stale(v)]
                     if any(map(group_type, set(map(type, list(values.values()))))) else [])
        except Exception:
            names = []
        for name in names:  # e.g. deepspeed.utils.groups._WORLD_GROUP: None is its "not created yet"
            try:
                setattr(module, name, None)
                released.append(f"{module.__name__}.{name}")
            except Exception:
                pass
        for func in _holding(module, is_group):
            defaults = func.__defaults__
            if defaults and any(stale(d) for d in defaults):
                func.__defaults__ = tuple(None if stale(d) else d for d in defaults)
                released.append(f"{func.__module__}.{func.__qualname__}")
            kw = func.__kwdefaults__
            if kw and any(stale(v) for v in kw.values()):
                func.__kwdefaults__ = {k: None if stale(v) else v for k, v in kw.items()}
                released.append(f"{func.__module__}.{func.__qualname__}")
    return released


def _holding(module: types.ModuleType, is_group: Any) -> list[types.FunctionType]:
    """The module's functions with a process group among their defaults (any: registered or not), walked once
    a module (``_walked``); none for a module imported before the first group (``_before_groups``)."""
    name = getattr(module, "__name__", "")
    seen = _walked.get(name)
    if seen is not None and seen[0] == id(module):
        return seen[1]
    found: list[types.FunctionType] = []
    if _before_groups is None or name not in _before_groups:
        funcs = list(_functions(module))
        # every default of the module's functions at once, mapped in C: most modules hold no group in any
        defaults = list(chain.from_iterable(filter(None, map(_DEFAULTS, funcs))))
        defaults += chain.from_iterable(map(dict.values, filter(None, map(_KWDEFAULTS, funcs))))
        if any(map(is_group, defaults)):
            found = [f for f in funcs if any(map(is_group, f.__defaults__ or ()))
                     or any(map(is_group, (f.__kwdefaults__ or {}).values()))]
    _walked[name] = (id(module), found)
    return found


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
