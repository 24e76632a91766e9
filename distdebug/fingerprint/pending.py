"""Fingerprints of many named tensors at once, read now or with the step's one host read.

Why a room of its own: every detector that compares tensors across ranks or across time (replicas, batches,
initial parameters, checkpoints, a re-executed step) fingerprints a list of named tensors the same way: CPU
tensors on the host at once (fingerprint.hashing's fast or portable fingerprint), device tensors' sums launched
on their device and read later with everything else (``PendingFingerprints``, ``rows_to_read``,
``finish_read``), or all read now (``fingerprints``). The fingerprint itself is defined in fingerprint.hashing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from distdebug import envvars
from distdebug.fingerprint.hashing import (
    combine_device,
    cpu_sums_many,
    device_sums,
    shape_seed,
)
from distdebug.fingerprint.hostpass import IS_CPU
from distdebug.fingerprint.many import fast_cpu_fingerprints, host_fingerprints, host_grad_fingerprints


class Run(NamedTuple):
    """A list of tensors and the slice of a list of names it fills (``PendingFingerprints.of``): e.g. the
    parameters at every even place and their gradients at every odd one."""

    where: slice
    tensors: list[Any]
    grads_of: list[Any] | None = None
    """The parameters these are the gradients of, one for one (their seeds serve: ``host_grad_fingerprints``)."""


class PendingFingerprints:
    """Fingerprints of named tensors whose device part is not read yet.

    CPU tensors are done at once on the host. Device tensors' sums are launched on their device and
    kept as one (N, 2) int64 tensor per device (``device_rows``); the caller reads them when it reads
    everything else (the step's one host read) and calls ``finish`` with the values. Only dtype and
    shape are kept of each tensor, never the tensor.
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]], portable: bool = False) -> None:
        """``portable``: CPU tensors take the portable fingerprint (comparable with a copy on another
        device), else the fast one (for comparisons across ranks of one job)."""
        self._take([n for n, _ in named], [t for _, t in named], portable)

    @classmethod
    def of(cls, names: list[str], runs: list[Run], portable: bool = False) -> PendingFingerprints:
        """The same from the names and the runs of tensors that fill them (``Run``). CPU runs are hashed a run
        at a time, so a list that comes back every step (the parameters) reuses its plan (``fingerprint.many``)
        whatever else is hashed with it."""
        out = cls.__new__(cls)
        if not portable and not envvars.device_path_forced():
            fps: list[int] = [0] * len(names)
            for where, ts, params in runs:
                got = host_fingerprints(ts) if params is None else host_grad_fingerprints(ts, params)
                if got is None:  # not all plain CPU tensors: the general way below
                    break
                fps[where] = got
            else:
                out.names, out.parts, out._in_order = names, [], True
                out.done = dict(zip(names, fps, strict=True))
                return out
        tensors: list[Any] = [None] * len(names)
        for where, ts, _ in runs:
            tensors[where] = ts
        out._take(names, tensors, portable)
        return out

    def _take(self, names: list[str], tensors: list[torch.Tensor], portable: bool) -> None:
        self.names = names
        self._in_order = False
        self.done: dict[str, int] = {}
        forced = envvars.device_path_forced()
        on_host: list[tuple[str, torch.Tensor]] = []
        by_device: dict[Any, list[tuple[str, torch.Tensor]]] = {}
        if not forced and all(map(IS_CPU, tensors)):  # the common CPU case, without a loop of Python a tensor
            if portable:
                on_host = list(zip(names, tensors, strict=True))
            else:
                self.done = dict(zip(names, fast_cpu_fingerprints(tensors), strict=True))
        else:
            for name, t in zip(names, tensors, strict=True):
                if t.device.type == "cpu" and not forced:
                    on_host.append((name, t))
                else:
                    by_device.setdefault(t.device, []).append((name, t))
        if on_host and portable:
            for (name, t), sums in zip(on_host, cpu_sums_many([t for _, t in on_host]), strict=True):
                self.done[name] = combine_device(sums, t)
        elif on_host:
            self.done.update(zip([n for n, _ in on_host], fast_cpu_fingerprints([t for _, t in on_host]), strict=True))
        self.parts: list[tuple[list[str], list[int], torch.Tensor]] = [
            ([n for n, _ in items], [shape_seed(t) for _, t in items], device_sums([t for _, t in items]))
            for items in by_device.values()
        ]

    @property
    def device_rows(self) -> list[torch.Tensor]:
        return [rows for _, _, rows in self.parts]

    def finish(self, host_rows: list[list[list[int]]] | None = None) -> dict[str, int]:
        """The fingerprints, in the caller's order; ``host_rows``: each device part as read (None: read now)."""
        if self._in_order:  # every tensor done on the host, in the caller's order (``of``): as it is
            return self.done
        if host_rows is None:
            host_rows = [rows.tolist() for rows in self.device_rows]  # one read per device
        out = dict(self.done)
        for (names, seeds, _), rows in zip(self.parts, host_rows, strict=True):
            for name, seed, fp in zip(names, seeds, rows, strict=True):
                out[name] = combine_device(fp, seed)
        return {name: out[name] for name in self.names}


def rows_to_read(parts: list[PendingFingerprints]) -> dict[str, torch.Tensor]:
    """The device rows of several pending fingerprint sets, keyed for a detector's probe (runtime.readout)."""
    return {f"{i}.{j}": rows for i, part in enumerate(parts) for j, rows in enumerate(part.device_rows)}


def finish_read(parts: list[PendingFingerprints], values: dict[str, Any]) -> dict[str, int] | None:
    """The fingerprints of ``parts`` from the values read under rows_to_read's keys, in order; None when
    a row is missing (the step's read failed)."""
    fps: dict[str, int] = {}
    for i, part in enumerate(parts):
        keys = [f"{i}.{j}" for j in range(len(part.device_rows))]
        if any(k not in values for k in keys):
            return None
        fps.update(part.finish([values[k] for k in keys]))
    return fps


def fingerprints(named: list[tuple[str, torch.Tensor]], portable: bool = False) -> dict[str, int]:
    """Fingerprint many tensors now: CPU ones on the host, device ones on the device, one read per device.
    ``portable``: the same value for a tensor and its copy on another device (see the module's docstring)."""
    return PendingFingerprints(named, portable).finish()
