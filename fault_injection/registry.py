"""The catalogue: fault name -> class. A plain dict; one module per fault."""

from __future__ import annotations

import json
from typing import Any

from .bad_env import BadEnv
from .base import Fault, parse_spec
from .bitflip_param import BitflipParam
from .checkpoint_corruption import CheckpointCorruption
from .duplicate_data import DuplicateData
from .grad_summed import GradSummed
from .hang import Hang
from .local_clip import LocalClip
from .loss_spike import LossSpike
from .low_dtype_state import LowDtypeState
from .lr_scaled import LrScaled
from .nan_activation import NanActivation
from .nan_grad import NanGrad
from .persistent_compute import PersistentCompute
from .probe import Probe
from .rank_dropout import RankDropout
from .seed_mismatch import SeedMismatch
from .skip_step import SkipStep
from .slow_dataloader import SlowDataloader
from .slow_link import SlowLink
from .straggler import Straggler
from .transient_compute import TransientCompute
from .unreduced_grad import UnreducedGrad
from .unsynced_bn import UnsyncedBn

FAULTS: dict[str, type[Fault]] = {cls.name: cls for cls in (
    NanGrad, NanActivation, BitflipParam, SkipStep, UnsyncedBn, BadEnv, Hang, Straggler, SlowDataloader,
    LossSpike, DuplicateData, SeedMismatch, CheckpointCorruption, SlowLink, TransientCompute, PersistentCompute,
    GradSummed, LrScaled, UnreducedGrad, LocalClip, LowDtypeState, RankDropout)}


def resolve(spec: str) -> dict[str, Any]:
    """``--inject`` spec -> what the ranks load (import path and typed parameters). ``probe`` (the replay's
    clean run, which acts on nothing) is accepted too, but not listed in the catalogue."""
    cls, params = parse_spec(spec, FAULTS) if spec.strip() != "probe" else (Probe, {})
    return {"target": f"{cls.__module__}:{cls.__name__}", "params": params}


def encode(specs: list[str]) -> str:
    return json.dumps([resolve(s) for s in specs])
