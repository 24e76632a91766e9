"""The catalogue: fault name -> class. A plain dict; one module per fault."""

from __future__ import annotations

import json
from typing import Any

from fault_injection.bad_env import BadEnv
from fault_injection.base import Fault, parse_spec
from fault_injection.bitflip_param import BitflipParam
from fault_injection.checkpoint_corruption import CheckpointCorruption
from fault_injection.duplicate_data import DuplicateData
from fault_injection.hang import Hang
from fault_injection.loss_spike import LossSpike
from fault_injection.nan_activation import NanActivation
from fault_injection.nan_grad import NanGrad
from fault_injection.persistent_compute import PersistentCompute
from fault_injection.probe import Probe
from fault_injection.seed_mismatch import SeedMismatch
from fault_injection.skip_step import SkipStep
from fault_injection.slow_dataloader import SlowDataloader
from fault_injection.slow_link import SlowLink
from fault_injection.straggler import Straggler
from fault_injection.transient_compute import TransientCompute
from fault_injection.unsynced_bn import UnsyncedBn

FAULTS: dict[str, type[Fault]] = {cls.name: cls for cls in (
    NanGrad, NanActivation, BitflipParam, SkipStep, UnsyncedBn, BadEnv, Hang, Straggler, SlowDataloader,
    LossSpike, DuplicateData, SeedMismatch, CheckpointCorruption, SlowLink, TransientCompute, PersistentCompute)}


def resolve(spec: str) -> dict[str, Any]:
    """``--inject`` spec -> what the ranks load (import path and typed parameters). ``probe`` (the replay's
    clean run, which acts on nothing) is accepted too, but not listed in the catalogue."""
    cls, params = parse_spec(spec, FAULTS) if spec.strip() != "probe" else (Probe, {})
    return {"target": f"{cls.__module__}:{cls.__name__}", "params": params}


def encode(specs: list[str]) -> str:
    return json.dumps([resolve(s) for s in specs])
