"""What every mechanism of nan_origin shares: the per-rank state (flags of the step in progress, the
watch's hooks, the capture, the state checks) and the record of one state check.

Why a module of its own: each mechanism (watch.py, replay.py, collectives.py, gradients.py, state.py,
verdict.py) is a class over this one set of fields, and ``NanOrigin`` (the package) composes them; the
fields are declared once here so each class can be read, and type-checked, on its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distdebug.config import NanOriginConfig
from distdebug.context import RankContext
from distdebug.detectors.base import Detector
from distdebug.fingerprint.hostpass import HostPass


@dataclass
class StateCheck:
    """A model's parameters and buffers checked whole, as they were at one moment: before its first step
    (what it was built, initialised or loaded with) or right after a ``load_state_dict``. A tensor that is
    non-finite there was never made finite by training: not an op's or a batch's NaN."""

    when: str
    where: str  # the user's line of the load ('' when not a load)
    names: list[str]
    flags: torch.Tensor  # max |x| of each, on the device
    refs: list[Any]  # weak references to the tensors: what the script did to them after the check is seen
    missing: list[str]  # the load's missing keys (strict=False: left as they were, not loaded)


class NanOriginState(Detector):
    """The fields the mechanisms read and write (one object per rank: the detector itself)."""

    def __init__(self, config: NanOriginConfig | None = None) -> None:
        self.config = config or NanOriginConfig()
        self.stop = self.config.stop
        self.ctx: RankContext | None = None
        self.names: dict[int, str] = {}  # id(param) -> name as the user wrote it
        self.params: list[tuple[str, torch.nn.Parameter]] = []
        self._plain: list[torch.Tensor] = []  # the parameters alone (watch.probe)
        self.grad_ptrs: dict[int, str] = {}
        self._host_params = HostPass()  # the parameters' finiteness on the host, on a CPU (fingerprint.hostpass)
        # Bounded whatever the loop does (any number of forwards, buckets or all_reduces per step): one
        # value per module / parameter group, later ones folded in by max(|sum|) (fold_in).
        self.fwd: dict[str, torch.Tensor] = {}  # module -> |sum| of its outputs this step, in forward order
        # A pipeline stage's input as received: what tells a NaN born here from one received (as comm_in /
        # comm_out below do for tensor-parallel layers).
        self.stage_input: dict[str, torch.Tensor] = {}
        self.shards: dict[str, torch.Tensor] = {}  # FSDP2 module -> its local shards (before the all-gather)
        self.gathered: dict[str, torch.Tensor] = {}  # FSDP2 module -> the parameters it gathered
        self._tp = False  # the model has tensor-parallel layers (runtime.layout)
        self._tp_current: str | None = None  # the TP module whose forward is running (its hooks set it)
        self.comm_in: dict[str, torch.Tensor] = {}  # TP module -> |sum| of what its collectives were given
        self.comm_out: dict[str, torch.Tensor] = {}  # ... and of what they returned
        self.stage: dict[str, Any] | None = None  # the layout's pipeline stage (runtime.layout)
        self.local: dict[tuple[str, ...], torch.Tensor] = {}  # param names -> |sum| of their local gradients
        self.local_source: str | None = None  # "ddp" | "all_reduce"
        self.sharded = False
        self.framework_reduces = False  # FSDP2 / DeepSpeed reduce the gradients inside
        self._ddp_seen: set[int] = set()  # DDP wrappers whose parameters are hooked (ids: never the object)
        self.first_step: int | None = None
        self.count = 0
        self._step_records: tuple[list[Any], list[Any]] = ([], [])  # (fwd, local) of the step being read
        # comm_in, comm_out, stage_input, shards, gathered: of the step being read
        self._forward_records: tuple[dict[str, Any], ...] = ({}, {}, {}, {}, {})
        self._readers: list[tuple[Any, Any]] = []  # (runtime.localgrads.LocalGradNorms, this detector's listener)
        self.watch = self.config.watch  # "on-demand" or "full", as attached (config.NanOriginConfig.watch)
        self.watch_blockers: list[str] = []  # why on-demand watch could not be had here
        self._watch: list[tuple[Any, str, Any, dict[str, Any]]] = []  # the forward's per-step watching
        self._recorder: Any = None  # on-demand watch: the step's capture (runtime.rerun.Recorder, forward only)
        self._capture_handles: list[Any] = []
        self._localised = ""  # why the last on-demand localisation could not run ('' when it ran)
        # Parameters and buffers checked whole before a model's first step and after each load, until the
        # next boundary reads them (bounded: MAX_STATE_CHECKS); those of the step being read.
        self._state: list[StateCheck] = []
        self._state_records: list[StateCheck] = []
        self._first_forward_seen: set[int] = set()  # ids of the models already checked (never the objects)
        self._to_empty_at = ""  # the user's line of the last Module.to_empty() (memory left uninitialised)
