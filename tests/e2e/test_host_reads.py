"""Tier 3 (CLI): the whole harness makes one device-to-host read per step, and none in any hook.

On a GPU every read of a device tensor (``.item()``, ``float(t)``, ``.tolist()``, ``.cpu()``...) makes
the host wait for the device. The recipes run under ``distdebug attach`` with every default
detector, through ``tests/data/scripts/count_reads.py``, which counts the reads whose caller is
distdebug's code on the training thread; ``DISTDEBUG_DEVICE_PATH=1`` sends CPU tensors down the
fingerprint's device path, so that CPU counts what a GPU run reads. The counter is proven to see
reads by the one read it must find at every boundary (the readout's).

Needs: 2 ranks and 9 steps: the count per step must be steady after the first steps' one-time reads.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import DATA, RECIPES, distdebug, make_env

COUNTER = str(DATA / "scripts" / "count_reads.py")


@pytest.mark.parametrize("recipe", [
    ["ddp_convnet.py"],
    ["fsdp2_transformer.py"],
    ["deepspeed_zero.py", "--zero-stage", "3"],
], ids=["ddp", "fsdp2", "zero3"])
def test_one_host_read_per_step_and_none_in_hooks(recipe, tmp_path):
    out = tmp_path / "reads"
    out.mkdir()
    r = distdebug("attach", "--run-dir", str(tmp_path / "run"), COUNTER, str(out), str(RECIPES / recipe[0]),
                  *recipe[1:], "--steps", "9", env=make_env(DISTDEBUG_DEVICE_PATH="1"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        counts = json.loads((out / f"reads-rank{rank}.json").read_text())
        assert counts["elsewhere"] == 0, counts["sites"]  # forward/backward hooks, patches: never
        per_step = {int(k): v for k, v in counts["boundary"].items()}
        assert per_step == {s: 1 for s in range(1, 10)}, counts["sites"]
