"""The one contract between the launcher and its ranks: every DISTDEBUG_* variable, in one place.

The launcher sets these in its own environment before calling torch's elastic launcher, which
hands its environment to every worker process unchanged.
"""

from __future__ import annotations

import os

RUN_DIR = "DISTDEBUG_RUN_DIR"
"""Absolute path of the run directory (shared by all ranks of this node)."""

DETECTORS = "DISTDEBUG_DETECTORS"
"""Comma-separated detector specs (registered names or ``file.py:Class`` / ``module:Class``)."""

TARGET_IS_MODULE = "DISTDEBUG_TARGET_IS_MODULE"
"""``1`` when the target was given with ``-m`` (run as a module, like ``python -m``)."""

NODE_RANK = "DISTDEBUG_NODE_RANK"
"""The ``--node-rank`` this launcher was given (c10d rendezvous may assign another group rank)."""

PARENT_WATCH = "DISTDEBUG_PARENT_WATCH"
"""``0`` disables the watchdog that ends a rank whose launcher died (default on)."""

STALL_TIMEOUT = "DISTDEBUG_STALL_TIMEOUT"
"""Seconds without progress (no step, no collective finished) after which a rank dumps its
stacks and Flight Recorder buffer; ``0`` turns stall detection off."""

FINGERPRINT_EVERY = "DISTDEBUG_FINGERPRINT_EVERY"
"""Cross-rank fingerprint check every K optimizer steps (default 1)."""

STOP_ON_NAN = "DISTDEBUG_STOP_ON_NAN"
"""``1``: a rank ends with EXIT_NAN after reporting its first NaN/Inf (detector nan_origin)."""

SPIKE_THRESHOLD = "DISTDEBUG_SPIKE_THRESHOLD"
"""Robust z above the window's median at which a loss or gradient norm counts as a spike (default 8)."""

SPIKE_WINDOW = "DISTDEBUG_SPIKE_WINDOW"
"""Steps of history a spike is measured against (default 50)."""

DETERMINISTIC = "DISTDEBUG_DETERMINISTIC"
"""``1``: seed every generator and turn on torch's deterministic algorithms before the script."""

INJECT = "DISTDEBUG_INJECT"
"""JSON list of ``{"target": "module:Class", "params": {...}}``: faults to run in every rank
(``attach --inject``), built before the detectors so that they act first."""

PROFILE_STEPS = "DISTDEBUG_PROFILE_STEPS"
"""``A:B[,C:D]``: optimizer steps to trace with torch.profiler on every rank."""
PROFILE_ON_FINDING = "DISTDEBUG_PROFILE_ON_FINDING"
"""Steps to trace on every rank after a detector fires (0: off)."""

DEBUG = "DISTDEBUG_DEBUG"
"""Set (to anything): the CLI lets distdebug's own traceback through for an internal error."""

ALL = (RUN_DIR, DETECTORS, TARGET_IS_MODULE, NODE_RANK, PARENT_WATCH, STALL_TIMEOUT, FINGERPRINT_EVERY, STOP_ON_NAN,
       SPIKE_THRESHOLD, SPIKE_WINDOW, DETERMINISTIC, INJECT, PROFILE_STEPS, PROFILE_ON_FINDING)


def encode_list(items: list[str]) -> str:
    return ",".join(items)


def decode_list(value: str | None) -> list[str]:
    if not value:
        return []
    return [item.strip() for item in value.split(",") if item.strip()]


def get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)
