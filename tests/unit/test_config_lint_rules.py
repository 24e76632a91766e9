"""Tier 1 (pure): config_lint's reading of a DeepSpeed engine's resolved settings, on an object that
answers DeepSpeed's engine accessors (fp16_enabled, dynamic_loss_scale, loss_scale,
zero_offload_param). The live-engine twin is tests/e2e/test_config_errors.py, which needs fp16 on the
CPU for this rule; this proves the rule on every machine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from distdebug.detectors.config_lint import ConfigLint


class Engine:
    def __init__(self, fp16: bool, dynamic: bool, scale: float) -> None:
        self._fp16, self._dynamic, self._scale = fp16, dynamic, scale
        self._config = SimpleNamespace(activation_checkpointing_config=None)

    def fp16_enabled(self) -> bool:
        return self._fp16

    def dynamic_loss_scale(self) -> bool:
        return self._dynamic

    def loss_scale(self) -> float:
        return self._scale

    def zero_offload_param(self) -> None:
        return None


@pytest.mark.parametrize("fp16, dynamic, expected", [
    (True, False, ["fp16 static loss scale"]),
    (True, True, []),
    (False, False, []),  # bf16 or fp32: no loss scale to fix
])
def test_fp16_with_a_fixed_loss_scale_is_named(fp16, dynamic, expected):
    det = ConfigLint()
    det.ctx = SimpleNamespace(rank=1)
    found = det._engine_config(Engine(fp16, dynamic, 128.0))
    assert [f.subject for f in found] == expected
    for f in found:
        assert f.ranks == [1] and f.step == 1 and f.evidence == {"loss_scale": 128.0}
        assert "fixed loss scale of 128" in f.message
