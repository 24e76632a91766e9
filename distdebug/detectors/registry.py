"""Detector registry: a plain dict from name to class, plus ``file.py:Class`` / ``module:Class`` plugins."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from pathlib import Path
from typing import Any

from distdebug.config import build_options
from distdebug.detectors.base import Detector
from distdebug.errors import UserError


def builtin() -> dict[str, type[Detector]]:
    """Every registered detector by name."""
    return _builtin()


def _builtin() -> dict[str, type[Detector]]:
    # Imported when first asked for, not at module load: importing the registry (the CLI, the
    # launcher) does not import every detector module and torch with it.
    from distdebug.detectors.bn_divergence import BatchNormDivergence
    from distdebug.detectors.checkpoint_roundtrip import CheckpointRoundTrip
    from distdebug.detectors.config_lint import ConfigLint
    from distdebug.detectors.data_order import DataOrder
    from distdebug.detectors.env_check import EnvCheck
    from distdebug.detectors.init_seed import InitSeed
    from distdebug.detectors.loss_nonfinite import LossNonFinite
    from distdebug.detectors.loss_scale import LossScale
    from distdebug.detectors.loss_spike import LossSpike
    from distdebug.detectors.memory import Memory
    from distdebug.detectors.nan_origin import NanOrigin
    from distdebug.detectors.profiler import Profiler
    from distdebug.detectors.replica_divergence import ReplicaDivergence
    from distdebug.detectors.rerun import Rerun
    from distdebug.detectors.straggler import Straggler

    return {cls.name: cls for cls in (LossNonFinite, NanOrigin, ReplicaDivergence, CheckpointRoundTrip,
                                      BatchNormDivergence, LossSpike, LossScale, DataOrder, InitSeed, Straggler, Memory,
                                      Profiler, EnvCheck, ConfigLint, Rerun)}


def names() -> list[str]:
    return sorted(_builtin())


def chosen(listed: list[str] | None) -> list[str]:
    """``attach --detectors``: None -> the default ones; ``-name`` entries (all of them) -> the default ones
    less those (what the report's cost advice says to do); else exactly the ones listed."""
    if listed is None:
        return default_specs()
    minus = [s[1:] for s in listed if s.startswith("-")]
    if not minus:
        return list(listed)
    if len(minus) != len(listed):
        raise UserError(f"--detectors {','.join(listed)}: either name the detectors to run or, with '-', the ones "
                        "to leave out of the default set, not both", 2)
    defaults = default_specs()
    for name in minus:
        if name not in defaults:
            raise UserError(f"--detectors -{name}: '{name}' is not a default detector "
                            f"(default: {', '.join(defaults)})", 2)
    return [d for d in defaults if d not in minus]


def default_specs() -> list[str]:
    return sorted(name for name, cls in _builtin().items() if cls.default)


def _load_plugin(spec: str) -> type[Detector]:
    target, _, cls_name = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"detector file not found: {target} (in --detectors {spec})")
        mod_spec = importlib.util.spec_from_file_location(f"distdebug_plugin_{path.stem}", path)
        if mod_spec is None or mod_spec.loader is None:
            raise UserError(f"cannot import detector file {target}")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UserError(f"cannot import detector module '{target}': {e}") from None
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Detector)):
        raise UserError(f"'{spec}' does not name a distdebug.detectors.base.Detector subclass")
    return cls


def _check_spec(spec: str, known: dict[str, type[Detector]]) -> None:
    if ":" in spec:
        target = spec.rpartition(":")[0]
        if target.endswith(".py") and not Path(target).expanduser().is_file():
            raise UserError(f"detector file not found: {target} (in --detectors {spec})")
    elif spec not in known:
        raise UserError(
            f"unknown detector '{spec}'; known: {', '.join(sorted(known)) or 'none'} "
            "(or give file.py:Class / module:Class)"
        )


def _matches(spec: str, key: str) -> bool:
    """An option's detector key names this spec: the spec as given, or a plugin's class name."""
    return key == spec or (":" in spec and key == spec.rpartition(":")[2])


def resolve(specs: list[str], options: dict[str, dict[str, Any]] | None = None,
            shorthands: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The detectors of a run as specs ``{"target": name or import path, "params": {...}}``, checked here.

    ``options``: per detector (its name, its spec, or a plugin's class name), options from
    ``--detector-option``; an option for a detector that is not in the run is an error. ``shorthands``:
    the same from attach's own options (``--spike-threshold``...), which apply only when their detector
    runs. Each detector's options are typed and checked by building its config dataclass; the params
    sent to the ranks are that dataclass's fields, so a rank never sees an option it cannot take.
    Built-in detectors are checked against their classes (importing every detector module, and torch with
    it: the launcher imports torch for torchrun anyway); a plugin is imported only when it is given options.
    """
    known = _builtin()
    for spec in specs:
        _check_spec(spec, known)
    given: dict[str, dict[str, Any]] = {}
    for key, opts in (options or {}).items():
        named = next((s for s in specs if _matches(s, key)), None)
        if named is None:
            raise UserError(f"--detector-option {key}.…: no detector '{key}' in this run "
                            f"(detectors: {', '.join(specs) or 'none'})", 2)
        given.setdefault(named, {}).update(opts)
    for key, opts in (shorthands or {}).items():
        named = next((s for s in specs if _matches(s, key)), None)
        if named is not None:
            given[named] = {**opts, **given.get(named, {})}  # --detector-option wins over a shorthand
    out: list[dict[str, Any]] = []
    for spec in specs:
        params: dict[str, Any] = {}
        if spec in given:
            cls = _load_plugin(spec) if ":" in spec else known[spec]
            if cls.Config is None:
                raise UserError(f"detector {spec} takes no options (given: {', '.join(given[spec])})", 2)
            params = dataclasses.asdict(build_options(cls.Config, given[spec], spec))
        out.append({"target": spec, "params": params})
    return out


def validate(specs: list[str]) -> list[str]:
    """Check specs without importing plugins (a plugin's file is the user's: imported on the ranks only)."""
    known = _builtin()
    for spec in specs:
        _check_spec(spec, known)
    return specs


def build(specs: list[str] | list[dict[str, Any]]) -> list[Detector]:
    """Instantiate detectors for ``specs`` (names or plugin paths, or ``resolve``'s dicts), in order."""
    known = _builtin()
    detectors: list[Detector] = []
    for item in specs:
        spec, params = (item, {}) if isinstance(item, str) else (item["target"], item.get("params") or {})
        cls = _load_plugin(spec) if ":" in spec else known.get(spec)
        if cls is None:
            raise UserError(f"unknown detector '{spec}'")
        det = cls(cls.Config(**params)) if cls.Config is not None else cls()  # type: ignore[call-arg]
        if not det.name:
            det.name = spec  # type: ignore[misc]
        detectors.append(det)
    return detectors


def build_injected(encoded: str | None) -> list[Detector]:
    """The faults of ``attach --inject`` (envvars.INJECT), each built with its parameters.

    Faults live outside this package (fault_injection/) and reach the ranks by import path only,
    so that distdebug never imports them; to the session they are detectors that act.
    """
    import json

    out: list[Detector] = []
    for item in json.loads(encoded or "[]"):
        cls = _load_plugin(item["target"])
        out.append(cls(**item.get("params", {})))
    return out
