"""What a collective call was, read from its arguments however the script wrote them: the tensors' shapes
(what tells two ranks' calls of the same collective apart), a point-to-point call's peer and tag, and the
script's frame that made it (kept with the in-flight record: a rank that dies inside the collective is still
placed). Pure functions of the call's arguments and the stack; ``runtime.patches`` calls them."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

NOT_THE_CALLER = (f"{os.sep}site-packages{os.sep}", f"{os.sep}distdebug{os.sep}", "<frozen ",
                   f"{os.sep}lib{os.sep}python3")


def call_site(depth: int) -> dict[str, Any] | None:
    """The script's frame that called the collective (torch's, ours and the standard library's skipped):
    kept with the in-flight record, so that a rank that dies inside the collective before any Python
    runs again (and before its fatal-signal dump is complete) is still placed."""
    try:
        f: Any = sys._getframe(depth)
    except ValueError:
        return None
    for _ in range(32):
        if f is None:
            return None
        name = f.f_code.co_filename
        if not any(m in name for m in NOT_THE_CALLER):
            return {"file": name, "line": f.f_lineno, "func": f.f_code.co_name}
        f = f.f_back
    return None


P2P = ("send", "recv", "isend", "irecv")
"""Point-to-point operations: recorded with their peer and tag (pipeline stages, Megatron's P2P), so a
hang names which peer each side waits for."""


def p2p_peer(name: str, args: Any, kwargs: Any) -> dict[str, Any]:
    """``{"peer": global rank, "tag": tag}`` of a send/recv call however it was written (``dst``/``src``
    or ``group_dst``/``group_src`` keywords, or positional), None where not given."""
    side = "dst" if name in ("send", "isend") else "src"
    peer = kwargs.get(side, args[1] if len(args) > 1 else None)
    out: dict[str, Any] = {"peer": peer if isinstance(peer, int) else None}
    group_peer = kwargs.get(f"group_{side}")
    if out["peer"] is None and isinstance(group_peer, int):
        # a rank within the group (how torch.distributed.pipelining calls them): its global rank
        out["group_peer"] = group_peer
        group = kwargs.get("group", args[2] if len(args) > 2 else None)
        try:
            import torch.distributed as dist

            out["peer"] = group_peer if group is None else int(dist.get_global_rank(group, group_peer))
        except Exception:  # a group this rank cannot resolve: the group rank alone is kept
            pass
    tag = kwargs.get("tag", args[3] if len(args) > 3 else 0)
    out["tag"] = tag if isinstance(tag, int) else 0
    return out


TENSOR_ARGS = ("tensor", "output", "input", "output_tensor", "input_tensor", "tensor_list", "output_tensor_list",
               "input_tensor_list", "output_list", "input_list", "gather_list", "scatter_list")
"""Keyword names torch.distributed's collectives take their tensors by (DeepSpeed's comm wrappers pass
``output=``/``input=``); with the first two positional arguments, where the shapes are read from."""
SPLIT_ARGS = ("output_split_sizes", "input_split_sizes")


def call_shapes(args: Any, kwargs: Any) -> list[Any] | None:
    """The shapes of a collective's tensors however it was called (positional or keyword, tensors or
    lists of them), in argument order, and all_to_all_single's split sizes: what tells two ranks'
    calls of the same collective apart. None when it takes no tensor (object collectives, barrier)."""
    out: list[Any] = []
    for obj in [*args[:2], *(kwargs[k] for k in TENSOR_ARGS if k in kwargs)]:
        shapes = shapes_of(obj)
        if shapes:
            out += shapes
    for i, key in enumerate(SPLIT_ARGS):
        splits = kwargs.get(key, args[2 + i] if len(args) > 2 + i else None)
        if isinstance(splits, (list, tuple)) and splits and all(isinstance(v, int) for v in splits):
            out.append({key.split("_")[0]: list(splits)[:8]})
    return out or None


def shapes_of(obj: Any) -> list[list[int]] | None:
    """Shapes of a collective's tensor argument (a tensor or a list of tensors; at most 4 listed)."""
    if isinstance(obj, torch.Tensor):
        return [list(obj.shape)]
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], torch.Tensor):
        return [list(x.shape) for x in obj[:4]]
    return None
