"""The replica check's tensors as runs (issue 62): the names keep each gradient beside its parameter, and the
fingerprints of the runs are those of the tensors named, whatever is absent or added."""

from __future__ import annotations

import pytest
import torch

from distdebug.detectors.replica_set import ReplicaSet
from distdebug.fingerprint.pending import PendingFingerprints, fingerprints
from distdebug.runtime.layout import Layout


def _pairs(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """What the check covers, as it was listed before the runs: each parameter, then its gradient, then state."""
    out: list[tuple[str, torch.Tensor]] = []
    for n, p in model.named_parameters():
        out.append((n, p))
        if p.grad is not None:
            out.append((n + ".grad", p.grad))
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        out += [(f"optimizer.{names[id(p)]}.{k}", v) for k, v in state.items() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("device_path", [False, True])
def test_runs_name_and_fingerprint_what_the_pairs_did(device_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the host's path and on the device's (forced: how a GPU's tensors go), the runs give the pairs' values."""
    if device_path:
        monkeypatch.setenv("DISTDEBUG_DEVICE_PATH", "1")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    replicas = ReplicaSet([model], [opt], Layout())
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        if step == 2:
            model[0].bias.requires_grad_(False)  # a frozen parameter: no gradient from here on
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        want = _pairs(model, opt)
        for with_state in (True, False):
            names, runs = replicas.tensors(with_state)
            expected = want if with_state else [(n, t) for n, t in want if "." in n and not n.endswith(".grad")
                                                and not n.startswith("optimizer.")]
            assert names == [n for n, _ in expected]
            assert PendingFingerprints.of(names, runs).finish() == fingerprints(expected)
    assert any(n.startswith("optimizer.") for n in replicas.tensors(True)[0])  # Adam's state was covered
    assert "0.bias.grad" not in replicas.tensors(True)[0]


def test_a_run_the_host_cannot_read_in_place_sends_all_the_general_way() -> None:
    """A strided gradient (assigned by the script): the runs are hashed as one list the general way, the same
    values as the pairs'."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    replicas = ReplicaSet([model], [opt], Layout())
    model(torch.randn(5, 4)).sum().backward()
    model[1].weight.grad = torch.randn(3, 4).t()
    names, runs = replicas.tensors(True)
    assert PendingFingerprints.of(names, runs).finish() == fingerprints(_pairs(model, opt))
