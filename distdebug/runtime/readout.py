"""The step's one device-to-host read, for the whole harness.

On a GPU every ``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()`` or ``.cpu()`` of a device tensor
makes the CPU wait until the device has finished all the work queued before it, which ends the
overlap of compute and communication. So no hook of the harness reads anything: detectors keep
their flags, norms and fingerprints as device tensors, and at the step boundary each hands them
to the session (``Detector.probe``), which adds the loss, packs everything into one int64 tensor per
device (floats travel as their float64 bits, so integers and fingerprints stay exact) and reads it
once. The values come back to each detector in its step event (``StepEvent.readout``).

On CPU the read is free, but it is the same single call: the tests count it there.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch


class Readout:
    """Device values queued for the boundary's read: ``add`` them, then ``read`` once."""

    def __init__(self) -> None:
        self._items: list[tuple[Any, torch.Tensor, tuple[int, ...], bool]] = []
        self._lists: set[Any] = set()  # add_many's keys (a key is add's or add_many's, never both)

    def add_many(self, key: Any, values: list[torch.Tensor]) -> None:
        """Queue several values under one key, read back as the list of their host values in order: packed with
        everything else, so a detector hands over its flags as they are and reduces them on the host, with no op
        of its own (issue 62: a stack and a max of a detector's own were three launches a step for one bit).
        All are checked before any is queued: a bad one refuses the whole list."""
        if not isinstance(values, list):
            raise TypeError(f"add_many takes a list of tensors, not {type(values).__name__}")
        for value in values:
            _check(value)
        self._lists.add(key)
        self._items += [(key, v, tuple(v.shape), v.is_floating_point()) for v in values]

    def add(self, key: Any, value: torch.Tensor) -> None:
        """Queue ``value`` (any shape; floating, integer or bool) under ``key``. Raises for anything
        else, at once, so that the caller's detector fails alone and the read never does. Nothing is
        dispatched here: the values are packed at the read, a few ops for them all (issue 62: five ops a value
        were most of the harness's ops a step, each a launch on a GPU)."""
        _check(value)
        self._items.append((key, value, tuple(value.shape), value.is_floating_point()))

    def __len__(self) -> int:
        return len(self._items)

    def read(self) -> dict[Any, Any]:
        """Every queued value on the host: one ``tolist`` per device (one in practice). Scalars come back
        as Python numbers, other shapes as nested lists; floats as float, the rest as int."""
        by_device: dict[Any, list[int]] = {}
        for i, (_, value, _, _) in enumerate(self._items):
            by_device.setdefault(value.device, []).append(i)
        host: dict[int, list[Any]] = {}
        with torch.no_grad():
            for indices in by_device.values():
                floats = [i for i in indices if self._items[i][3]]
                ints = [i for i in indices if not self._items[i][3]]
                fwords, forder = self._packed(floats, torch.float64) if floats else (None, [])
                iwords, iorder = self._packed(ints, torch.int64) if ints else (None, [])
                if fwords is not None and iwords is not None:
                    # both kinds in one read: int64 words, a float as its float64 bits (exact), turned back at once
                    words = torch.cat([fwords.view(torch.int64), iwords]).tolist()  # the read
                    nf = fwords.numel()
                    fvals = list(struct.unpack(f"<{nf}d", struct.pack(f"<{nf}q", *words[:nf])))
                    ivals = words[nf:]
                else:  # one kind only: read as it is (float64 and int64 come back exact); the other is empty
                    fvals = fwords.tolist() if fwords is not None else []  # the read, of floats
                    ivals = iwords.tolist() if iwords is not None else []  # or of integers
                for order, vals in ((forder, fvals), (iorder, ivals)):
                    pos = 0
                    for i in order:
                        n = math.prod(self._items[i][2])
                        host[i] = vals[pos:pos + n]
                        pos += n
        out: dict[Any, Any] = {key: [] for key in self._lists}
        for i, (key, _, shape, _) in enumerate(self._items):
            if key in self._lists:
                out[key].append(_shaped(host[i], shape))
            else:
                out[key] = _shaped(host[i], shape)
        self._items, self._lists = [], set()
        return out

    def _packed(self, indices: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
        """The values of ``indices`` end to end in one vector of ``dtype`` (one stack for every scalar, one cat,
        one conversion: exact, every dtype here widens into it), and the order of the items in it."""
        scalars = [i for i in indices if not self._items[i][2]]
        others = [i for i in indices if self._items[i][2]]
        parts = [torch.stack([self._items[i][1] for i in scalars])] if scalars else []
        for i in others:
            value = self._items[i][1]
            parts.append(value if value.dim() == 1 else value.reshape(-1))
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        return flat.to(dtype), scalars + others


def _check(value: Any) -> None:
    """Raises for what cannot be read out, at once, so that the caller's detector fails alone and the read never
    does."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a readout value must be a tensor, not {type(value).__name__}")
    if value.is_complex():
        raise TypeError("complex values cannot be read out")
    if value.layout is not torch.strided or value.is_meta:
        raise TypeError(f"a readout value must be a dense tensor with storage, not {value.layout} on "
                        f"{value.device}")


def _shaped(values: list[Any], shape: tuple[int, ...]) -> Any:
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    inner = 1
    for d in shape[1:]:
        inner *= d
    return [_shaped(values[i * inner:(i + 1) * inner], shape[1:]) for i in range(shape[0])]
