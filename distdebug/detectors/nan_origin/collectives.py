"""NaN that travels in the forward through communication: tensor-parallel layers' collectives (their
input and output around torch's all-reduce / redistribution) and FSDP2's parameter all-gather (this
rank's shards before it, the gathered parameters after it).

Why a mechanism of its own: a NaN received from a TP peer or gathered from another rank's shard makes this
rank's forward non-finite although nothing was born here; comparing what went in with what came back is
what tells "received" from "born" (verdict.py, ``_received``). Device flags only, no host read."""

from __future__ import annotations

from typing import Any

import torch

from distdebug.detectors.nan_origin.core import NanOriginState
from distdebug.detectors.nan_origin.flags import INF, finite_flag, fold_in


class Collectives(NanOriginState):
    """Hooks and the communication observer that record, per TP or FSDP2 module, what its collectives were
    given and what they returned."""

    def _tp_enter(self, label: str) -> Any:
        def hook(module: torch.nn.Module, *args: Any) -> None:
            self._tp_current = label if torch.is_grad_enabled() else None
        return hook

    def _tp_leave(self, label: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            self._tp_current = None
        return hook

    def _observe(self, inp: Any, out: Any) -> None:
        """A functional collective inside a TP module's forward: its input and output, as device flags."""
        label = self._tp_current  # set only in training forwards (the collective itself runs inside an autograd
        if label is None:         # Function's forward, where grad mode is off)
            return
        for acc, t in ((self.comm_in, inp), (self.comm_out, out)):
            t = getattr(t, "_local_tensor", t)
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                fold_in(acc, label, finite_flag(t.detach()))

    def _shard_hook(self, label: str, params: list[Any], sharded: bool) -> Any:
        """FSDP2: whether this rank's shards of the module's parameters are finite (before its all-gather)
        and whether the gathered parameters are (after it): a NaN in another rank's shard reaches every
        rank of the group through the all-gather, and only the rank holding it is its origin."""
        acc = self.shards if sharded else self.gathered

        def hook(module: torch.nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            ts = []
            for fp in params:
                t = fp.sharded_param if sharded else getattr(fp._module_info.module, fp._module_info.param_name, None)
                t = getattr(t, "_local_tensor", t)
                if isinstance(t, torch.Tensor) and t.numel() and t.is_floating_point():
                    ts.append(t.detach())
            if ts:
                fold_in(acc, label, torch.stack(torch._foreach_norm(ts, INF)).amax())  # a sum of maxima overflows
        return hook


def fsdp_params(module: Any) -> list[Any]:
    """The parameters an FSDP2 module shards and gathers itself (its FSDPParams), or []."""
    get = getattr(module, "_get_fsdp_state", None)
    if get is None:
        return []
    group = getattr(get(), "_fsdp_param_group", None)
    params = list(getattr(group, "fsdp_params", None) or [])
    return [p for p in params if hasattr(p, "sharded_param") and hasattr(p, "_module_info")]
