"""The fast CPU fingerprints of a list of tensors that comes back every step (issue 62).

Why a room of its own: the replica check hashes the parameters, the reduced gradients and the optimizer's state
every step, a thousand tensors and more, so what it costs a tensor is the harness's cost a tensor, and what it
keeps is what the interpreter's collector walks. Each fingerprint is ``hashing.fast_cpu_fingerprint`` (xxh3 of
the bytes in place, seeded by dtype and shape); what this adds is doing a list at once: every per-tensor read
(address, length, dtype, shape) mapped over the list in C, the seeds of a list of the same dtypes and shapes as a
recent one taken from it, and the byte views of a list that came back (the same tensors at the same addresses:
the parameters) kept and reused. The gradients, new tensors at new addresses every step, leave nothing behind.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import xxhash

from distdebug.fingerprint.hashing import FAST_TAG, fast_cpu_fingerprint, seed_for
from distdebug.fingerprint.hostpass import DATA_PTR, DTYPE, IS_CPU, NBYTES, SHAPE, byte_view, plain_cpu

_PLANS: list[tuple[Any, ...]] = []
"""The last few lists hashed (most recent first), each ``(ids, addresses, lengths, seeds, views)``: a replica check
hashes the same parameters every step. All but the views are tuples of ints, which the interpreter's collector
stops tracking at its first pass; the views (ctypes objects, tracked) are kept only once a list came back, so the
gradients, new tensors at new addresses every step, leave nothing behind that a collection would promote and
later walk (issue 62: about 200 objects a step at 1,000 tensors, a full collection of 0.1 s every 200 steps)."""


def fast_cpu_fingerprints(tensors: list[torch.Tensor]) -> list[int]:
    """``fast_cpu_fingerprint`` of each CPU tensor (``host_fingerprints``, or one at a time for those it leaves)."""
    fps = host_fingerprints(tensors)
    # A DTensor's local part or a contiguous copy: a new tensor at each call, nothing to reuse
    return fps if fps is not None else [fast_cpu_fingerprint(t) for t in tensors]


def host_fingerprints(tensors: list[torch.Tensor]) -> list[int] | None:
    """``fast_cpu_fingerprint`` of each of these tensors when they are all plain contiguous CPU tensors, read in
    place; None when they are not (a device's, a DTensor, a strided view). The same tensors (the same objects, at
    the same addresses and lengths) as a recent call reuse its seeds, and from the second repeat on its byte
    views: what is left is one xxh3 call a tensor, about 0.1 us with the checks, against 0.6 us to make them.
    Nothing here holds a tensor: a plan keeps ids, addresses and lengths, checked against the live tensors (which
    the caller holds) before any byte is read. Not checked on a repeat (as before issue 62): a tensor's dtype,
    shape and strides changed in place over the same bytes (``t_()``, ``set_``), which keeps the seed of the
    shape it had."""
    if tensors and not IS_CPU(tensors[0]):  # a device's: told at its first tensor, before anything read a tensor
        return None
    ids = tuple(map(id, tensors))
    for k, plan in enumerate(_PLANS):
        if plan[0] == ids:
            ptrs, nbytes = tuple(map(DATA_PTR, tensors)), tuple(map(NBYTES, tensors))
            if ptrs == plan[1] and nbytes == plan[2]:
                views = plan[4]
                if views is None:  # the list came back: its views are worth keeping now
                    views = list(map(byte_view, ptrs, nbytes))
                    plan = (ids, ptrs, nbytes, plan[3], views)
                del _PLANS[k]
                _PLANS.insert(0, plan)
                return list(map(xxhash.xxh3_64_intdigest, views, plan[3]))
            del _PLANS[k]
            break
    if plain_cpu(tensors):
        # Plain contiguous tensors (the gradients: new objects at new addresses every step): everything read per
        # tensor is mapped in C, and the seeds of the same dtypes and shapes as a recent list are that list's
        ptrs, nbytes = tuple(map(DATA_PTR, tensors)), tuple(map(NBYTES, tensors))
        seeds = _seeds_of(tuple(map(DTYPE, tensors)), tensors)
        fps = list(map(xxhash.xxh3_64_intdigest, map(byte_view, ptrs, nbytes), seeds))
        _PLANS.insert(0, (ids, ptrs, nbytes, seeds, None))
        del _PLANS[8:]
        return fps
    return None


def host_grad_fingerprints(grads: list[torch.Tensor], params: list[torch.Tensor]) -> list[int] | None:
    """``host_fingerprints`` of each gradient of ``params`` (``grads[i]`` is ``params[i].grad``, none None).
    Torch keeps a gradient's dtype and shape its parameter's (it refuses any other), so the seeds are the
    parameters' (their plan's, when they were just hashed and have the gradients' lengths) and nothing is
    planned: the gradients are new tensors at new addresses every step. What is left a tensor: its address and
    length, the check that it is a plain contiguous CPU tensor, and the hash (0.9 us against 1.2 in
    ``fast_cpu_fingerprints``, each after a backward)."""
    if (grads and not IS_CPU(grads[0])) or not plain_cpu(grads):
        return None
    ids, nbytes = tuple(map(id, params)), tuple(map(NBYTES, grads))
    seeds = next((plan[3] for plan in _PLANS if plan[0] == ids and plan[2] == nbytes), None)
    if seeds is None:  # the parameters not hashed just before, or resized since
        seeds = _seeds_of(tuple(map(DTYPE, grads)), grads)
    return list(map(xxhash.xxh3_64_intdigest, map(byte_view, map(DATA_PTR, grads), nbytes), seeds))


_LIST_SEEDS: list[tuple[tuple[Any, ...], tuple[Any, ...], tuple[int, ...]]] = []
"""(dtypes, shapes, seeds) of the last few lists hashed: a list of the same model's tensors comes back every step."""


def _seeds_of(dtypes: tuple[Any, ...], tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """The seeds of these tensors (``_seed(t) ^ FAST_TAG`` each), those of a recent list of the same dtypes and
    shapes. The shapes are compared as they are read, each dropped at once: a thousand of them held for the call
    would be objects made in bulk that the interpreter's collector catches alive (issue 62)."""
    for k, (d, shapes, seeds) in enumerate(_LIST_SEEDS):
        if d == dtypes and all(map(operator.eq, map(SHAPE, tensors), shapes)):
            if k:
                _LIST_SEEDS.insert(0, _LIST_SEEDS.pop(k))
            return seeds
    shapes = tuple(map(SHAPE, tensors))
    seeds = tuple(seed_for(dtype, shape) ^ FAST_TAG for dtype, shape in zip(dtypes, shapes, strict=True))
    _LIST_SEEDS.insert(0, (dtypes, shapes, seeds))
    del _LIST_SEEDS[8:]
    return seeds
