"""The rank's parallel layout: which ranks hold the same part of the model, and so must agree.

In plain data parallelism every rank is a replica of every other. In tensor, pipeline and 2-D
layouts most ranks are not: TP peers hold different shards and read the same batch by design,
pipeline stages hold different layers. Every cross-rank check asks this module which ranks to
compare (issue 21):

- the **data-parallel group** (``Layout.dp``): the ranks whose copies of the model's part this rank
  holds are replicas of its own, and whose batches must differ. It is the group the data-parallel
  wrapper reduces over (DDP's ``process_group`` / ``device_mesh``, FSDP2's mesh, ZeRO's data-parallel
  group); without a wrapper, the ranks that differ from this one only along the mesh dimensions no
  parameter is sharded on (a hand-written data-parallel loop over a TP mesh); with neither, every
  rank (plain data parallelism, a hand-written all-reduce).
- a **tensor's replica group** (``Layout.replicas``): for a DTensor (or a TP parameter DDP turned
  into a local tensor, which keeps its spec in ``_st_info``), the ranks of its mesh that share its
  coordinates on every dimension it is not replicated on, times the data-parallel group; for a plain
  tensor, the data-parallel group.

A group is a sorted list of global ranks; None means every rank; False means nobody else holds it
(nothing to compare). The layout is found once, at the end of discovery, from live objects, and kept
as plain data (ranks and names): no tensor or module is held.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

from distdebug.runtime.discovery import ddp_params  # DDP's parameters, as noted at its constructor

Group = list[int] | None | Literal[False]


def spec_of(t: Any) -> Any:
    """A tensor's DTensor spec: its own, or the one DDP kept on a localised TP parameter; else None."""
    spec = getattr(t, "_spec", None)
    if spec is not None and hasattr(spec, "placements"):
        return spec
    spec = getattr(t, "_st_info", None)
    return spec if spec is not None and hasattr(spec, "placements") else None


def _group_ranks(group: Any) -> list[int] | None:
    import torch.distributed as dist

    if group is None:
        return None
    try:
        return sorted(int(r) for r in dist.get_process_group_ranks(group))
    except Exception:  # a group this rank is not in, or a backend-private object
        return None


def _along(mesh: Any, dims: set[int]) -> list[int] | None:
    """The ranks of ``mesh`` that share this rank's coordinates on every dimension not in ``dims``.

    From the mesh's process groups (public API, no tensor read: the harness reads no tensor outside the
    step's one read, and ``DeviceMesh.mesh`` is rebuilt at each access): the group of each dimension in
    ``dims`` through this rank, combined as offsets from it, which is exact for the meshes
    ``init_device_mesh`` builds and their slices (ranks laid out in row-major order)."""
    if mesh.get_coordinate() is None:
        return None
    me = _rank()
    out = {me}
    for d in sorted(dims):
        ranks = _group_ranks(mesh.get_group(d)) if mesh.size(d) > 1 else [me]
        if ranks is None:
            return None
        out = {r + g - me for r in out for g in ranks}
    return sorted(out)


def _ranks(mesh: Any) -> list[int]:
    """Every rank of ``mesh`` (a slice of a larger mesh: the ranks of the slice through this one)."""
    return _along(mesh, set(range(mesh.ndim))) or []


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


@dataclass
class Layout:
    """Plain data: the meshes, each parameter's placements, the data-parallel wrapper and group, the
    pipeline stage. Built by ``find_layout``; read by every cross-rank check."""

    rank: int = 0
    world: int = 1
    dp: list[int] | None = None
    """The data-parallel group (see the module docstring); None: every rank."""
    dp_wrapper: str | None = None
    dp_source: str = "default"  # how the group was found: "ddp", "fsdp2", "deepspeed", "mesh", "pipeline", "default"
    meshes: list[dict[str, Any]] = field(default_factory=list)
    placements: dict[str, list[str]] = field(default_factory=dict)  # parameter -> placements per mesh dim
    sharded: list[str] = field(default_factory=list)  # parameters sharded by model parallelism (TP)
    stage: dict[str, Any] | None = None  # pipeline: {"index", "indices" (interleaved: several), "stages", "ranks"}
    model_parallel_by_hand: list[list[int]] = field(default_factory=list)  # forward all-reduce groups, unknown dp
    _root_dims: dict[str, int] = field(default_factory=dict)  # dim name -> index in the root mesh
    _root: Any = None  # weakref to the root DeviceMesh (for products of groups)
    _dp_dims: set[str] = field(default_factory=set)  # root-mesh dim names the data-parallel group spans
    _tp_dims: set[str] = field(default_factory=set)  # mesh dim names some parameter is sharded on (not dp)

    # ------------------------------------------------------------------ groups
    def data_group(self) -> Group:
        """The ranks whose batches must differ from this rank's (and that compute the same loss)."""
        return self._norm(self.dp)

    def replicas(self, t: Any) -> Group:
        """The ranks that hold the same values of ``t`` as this rank (the local shard, for a DTensor)."""
        return self.replicas_of_spec(spec_of(t))

    def replicas_of_spec(self, spec: Any) -> Group:
        """``replicas`` for a tensor with this DTensor spec (None: a plain tensor)."""
        if spec is None:
            return self._norm(self.dp)
        mesh = spec.mesh
        repl = {i for i, p in enumerate(spec.placements) if p.is_replicate()}
        names = getattr(mesh, "mesh_dim_names", None) or ()
        own = _along(mesh, repl)
        if own is None:
            return False
        if self.dp is None or set(self.dp) <= set(_ranks(mesh)) or (names and set(names) & self._dp_dims):
            # every rank is data parallel, or the tensor's mesh already spans the data-parallel
            # dimensions (FSDP2 and HSDP shard or replicate over them): its placements say it all
            return self._norm(own)
        # The data-parallel wrapper replicates across ranks outside the tensor's mesh (DDP over "dp"
        # of a ("dp", "tp") mesh): the product of both, through the root mesh when both are of it.
        root = self._root() if self._root is not None else None
        if root is not None and names and all(n in self._root_dims for n in names) and self._dp_dims:
            dims = {self._root_dims[names[i]] for i in repl} | {self._root_dims[n] for n in self._dp_dims}
            prod = _along(root, dims)
            if prod is not None:
                return self._norm(prod)
        # Not computable: the larger of the two known groups (each is a true subset of the replicas).
        return self._norm(own if len(own) >= len(self.dp) else self.dp)

    def _norm(self, ranks: list[int] | None) -> Group:
        if ranks is None or len(ranks) >= self.world:
            return None
        return False if len(ranks) <= 1 else sorted(ranks)

    # ------------------------------------------------------------------ presentation
    def label(self) -> str:
        """``dp=2 x tp=2, FSDP2 over dp, TP on w1,w2`` (or ``data parallel over 4 ranks``)."""
        parts = []
        if self.meshes:
            m = max(self.meshes, key=lambda m: len(m["dims"]))
            parts.append(" x ".join(f"{d}={s}" for d, s in zip(m["dims"], m["shape"], strict=True)))
        dp = self.data_group()
        if self.dp_wrapper == "manual":
            parts.append(f"gradients all-reduced by hand over ranks {dp}")
        elif self.dp_wrapper:
            over = "+".join(sorted(self._dp_dims)) if self._dp_dims else f"ranks {dp}" if dp else "every rank"
            wrapper = self.dp_wrapper.upper() if self.dp_wrapper in ("ddp", "fsdp2") else self.dp_wrapper
            parts.append(f"{wrapper} over {over}")
        if self.sharded:
            shown = sorted({n.rsplit(".", 1)[0] for n in self.sharded})
            parts.append("TP on " + ",".join(shown[:6]) + (" ..." if len(shown) > 6 else ""))
        if self.dp_source == "unknown":
            parts.append(f"model parallelism by hand (forward all-reduce over ranks {self.model_parallel_by_hand}); "
                         "data-parallel groups unknown: cross-rank checks off (give --replica-groups)")
        if self.stage is not None:  # last: the report turns it into every rank's stage
            parts.append(f"pipeline stage {_stages(self.stage)} of {self.stage['stages']}")
        if not parts:
            return f"data parallel over {self.world} ranks"
        return ", ".join(parts)

    def _explicit(self, group: Group) -> list[int]:
        return list(range(self.world)) if group is None else [self.rank] if group is False else group

    def describe(self) -> dict[str, Any]:
        return {
            "label": self.label(),
            # the ranks, this one included: all of them in plain data parallelism, only itself when no
            # other rank holds its part of the model
            "data_parallel_group": self._explicit(self.data_group()),
            "data_parallel_wrapper": self.dp_wrapper,
            "data_parallel_source": self.dp_source,
            "meshes": self.meshes,
            "tensor_parallel": self.sharded[:200],
            "placements": dict(list(self.placements.items())[:200]),
            "pipeline": self.stage,
            "model_parallel_by_hand": self.model_parallel_by_hand,
        }


def _stages(stage: dict[str, Any]) -> str:
    """``0``, or ``0, 2`` for a rank that runs several stages (an interleaved schedule)."""
    return ", ".join(str(i) for i in stage.get("indices") or [stage["index"]])


def partition(groups: dict[int, Group]) -> list[list[int]]:
    """Ranks split by their data-parallel groups as each rank stated its own (None: every rank; False:
    nobody else), keeping only parts of two or more ranks: what a cross-rank check compares."""
    parts: dict[Any, list[int]] = {}
    for rank in sorted(groups):
        group = groups[rank]
        key = "all" if group is None else ("alone", rank) if group is False else tuple(group)
        parts.setdefault(key, []).append(rank)
    return [ranks for ranks in parts.values() if len(ranks) > 1]


def _mesh_record(mesh: Any) -> dict[str, Any]:
    names = list(getattr(mesh, "mesh_dim_names", None) or [f"dim{i}" for i in range(mesh.ndim)])
    return {"dims": names, "shape": [int(mesh.size(i)) for i in range(mesh.ndim)], "ranks": _ranks(mesh)}


def find_layout(roots: list[Any], rank: int, world: int, grad_groups: dict[Any, int] | None = None,
                forward_groups: set[Any] | None = None) -> Layout:
    """The layout of this rank's models (live objects in, plain data out). ``grad_groups``: the process
    groups the script all-reduced gradients over by hand in step 1 (None: the default group), with how
    many gradients each: a hand-written layout's data-parallel group is where its gradients are reduced.
    ``forward_groups``: sub-groups all-reduced over inside a forward (model parallelism by hand)."""
    from distdebug.runtime.discovery import find_ddp, is_deepspeed_engine, unwrap

    lay = Layout(rank=rank, world=world)
    meshes: dict[int, Any] = {}
    for root in roots:
        inner, chain, _ = unwrap(root)
        ddp = find_ddp(root)
        dp_mesh: Any = None
        named: list[tuple[str, Any]] = list(inner.named_parameters())
        if ddp is not None:
            named = ddp_params(ddp) or named
            lay.dp_wrapper, lay.dp_source = "ddp", "ddp"
            lay.dp = _group_ranks(getattr(ddp, "process_group", None))
            dm = dp_mesh = getattr(ddp, "device_mesh", None)
            if dm is not None:
                meshes.setdefault(id(dm), dm)
                lay._dp_dims |= set(getattr(dm, "mesh_dim_names", None) or ())
        elif "fsdp2" in chain:
            lay.dp_wrapper, lay.dp_source = "fsdp2", "fsdp2"
            dm = dp_mesh = _fsdp2_mesh(inner)
            if dm is not None:
                meshes.setdefault(id(dm), dm)
                lay.dp = _ranks(dm)
                lay._dp_dims |= set(getattr(dm, "mesh_dim_names", None) or ())
        elif is_deepspeed_engine(root):
            lay.dp_wrapper, lay.dp_source = "deepspeed", "deepspeed"
            lay.dp = _group_ranks(getattr(root, "data_parallel_group", None) or getattr(root, "dp_group", None))
        for name, p in named:
            spec = spec_of(p)
            if spec is None:
                continue
            meshes.setdefault(id(spec.mesh), spec.mesh)
            lay.placements[name] = [str(x) for x in spec.placements]
            dims = getattr(spec.mesh, "mesh_dim_names", None) or ()
            if not dims and dp_mesh is not None and _ranks(spec.mesh) == _ranks(dp_mesh):
                continue  # the wrapper's own (unnamed) mesh: FSDP's sharding, not model parallelism
            tp_dims = [i for i, x in enumerate(spec.placements)
                       if not x.is_replicate() and (not dims or dims[i] not in lay._dp_dims)]
            if tp_dims:
                lay.sharded.append(name)
                lay._tp_dims |= {dims[i] for i in tp_dims if dims}
        stage = pipeline_stage(inner)
        if stage is not None:
            # An interleaved schedule runs several stages per rank (one model each): all are noted,
            # the first stands for the rank's position.
            indices = sorted({*(lay.stage or {}).get("indices", []), stage["index"]})
            lay.stage = {**stage, "index": indices[0], "indices": indices}
    roots_of = [m._get_root_mesh() if hasattr(m, "_get_root_mesh") else m for m in meshes.values()]
    if roots_of:
        root_mesh = max(roots_of, key=lambda m: m.ndim)
        lay._root = weakref.ref(root_mesh)
        lay._root_dims = {n: i for i, n in enumerate(getattr(root_mesh, "mesh_dim_names", None) or ())}
        lay.meshes = [_mesh_record(root_mesh)] + [_mesh_record(m) for m in meshes.values() if m is not root_mesh]
    if lay.dp_wrapper is None and grad_groups:
        # Hand-written data parallelism (Megatron-style layers, groups from new_group): the group most of
        # the gradients were all-reduced over (a TP layer's replicated parameters may also be reduced over
        # the TP group).
        group = max(grad_groups, key=lambda g: grad_groups[g])
        ranks = _group_ranks(group) if group is not None else None
        if ranks is not None and len(ranks) < world:
            lay.dp_wrapper, lay.dp_source, lay.dp = "manual", "gradient all-reduce", ranks
    if lay.dp_wrapper is None:
        _infer_dp(lay)
    if lay.dp_source == "default" and forward_groups:
        # Model parallelism by hand (a forward all-reduce over a sub-group) and no gradient reduction seen
        # per tensor (a flattened buffer): which ranks hold replicas is unknown. Compared with nobody,
        # never with the model-parallel peers by mistake (the report says so: --replica-groups).
        lay.dp, lay.dp_source = [rank], "unknown"
        lay.model_parallel_by_hand = sorted(filter(None, (_group_ranks(g) for g in forward_groups)))[:8]
    _override(lay)
    return lay


def _override(lay: Layout) -> None:
    """``attach --replica-groups 0,2;1,3``: the user's data-parallel groups, over whatever was inferred."""
    from distdebug.config import parse_replica_groups
    from distdebug.envvars import REPLICA_GROUPS, get

    text = get(REPLICA_GROUPS)
    if not text:
        return
    group = next((g for g in parse_replica_groups(text) if lay.rank in g), [lay.rank])
    lay.dp, lay.dp_source = group, "--replica-groups"


def _infer_dp(lay: Layout) -> None:
    """No data-parallel wrapper: the data-parallel group is what model parallelism leaves over."""
    root = lay._root() if lay._root is not None else None
    if lay.sharded:
        lay.dp_source = "mesh"
        if root is not None and lay._tp_dims and lay._tp_dims <= set(lay._root_dims):
            # a hand-written data-parallel loop over the other dimensions of the TP mesh's root mesh
            others = set(range(root.ndim)) - {lay._root_dims[n] for n in lay._tp_dims}
            lay.dp = _along(root, others) if others else [lay.rank]
            lay._dp_dims = {n for n, i in lay._root_dims.items() if i in others}
        else:
            # A TP mesh with no other dimension (or unnamed): nobody else holds this rank's shards, as far
            # as is known here: compared with nobody rather than with TP peers by mistake.
            lay.dp = [lay.rank]
    if lay.stage is not None and lay.dp is None:
        # Pipeline stages with no data-parallel wrapper: which ranks of other pipelines (if any) run this
        # stage is not known here, so no other rank is compared with this one.
        lay.dp, lay.dp_source = [lay.rank], "pipeline"


def _fsdp2_mesh(inner: Any) -> Any:
    """The mesh FSDP2 shards (and, for HSDP, replicates) over: its data-parallel mesh."""
    for m in inner.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is None:
            continue
        group = getattr(get(), "_fsdp_param_group", None)
        mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
        if mesh is not None:
            return mesh
    return None


def pipeline_stage(module: Any) -> dict[str, Any] | None:
    """The ``torch.distributed.pipelining`` stage running ``module``, if pipelining is in use: found
    through the objects that refer to the module, once (the package is never imported by us: it
    costs seconds)."""
    import gc
    import sys

    stage_mod = sys.modules.get("torch.distributed.pipelining.stage")
    if stage_mod is None:
        return None
    base = getattr(stage_mod, "_PipelineStageBase", None)
    for obj in gc.get_referrers(module):
        if base is not None and isinstance(obj, base) and getattr(obj, "submod", None) is module:
            return {"index": int(obj.stage_index), "stages": int(obj.num_stages),
                    "ranks": _group_ranks(obj.group) or list(range(int(obj.group_size)))}
    return None
