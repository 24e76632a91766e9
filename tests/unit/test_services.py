"""Tier 1: the launcher's side services (launch.services): started in order before the ranks, stopped in the
reverse order after them whatever happens; one that fails to start or stop is said and costs nothing else, but
the supervisor (the hang judge) is not optional."""

from __future__ import annotations

import pytest

from distdebug.launch.services import Services


class Recorder:
    def __init__(self, name: str, log: list[str], fail: str = "") -> None:
        self.name, self.log, self.fail = name, log, fail

    def start(self) -> None:
        if self.fail == "start":
            raise OSError("no terminal")
        self.log.append(f"start {self.name}")

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")
        if self.fail == "stop":
            raise RuntimeError("stuck")


def test_started_in_order_stopped_in_reverse_and_a_failing_one_costs_nothing_else(capsys):
    log: list[str] = []
    sup = Recorder("supervisor", log)
    services = Services(sup, None, [sup, Recorder("status", log, fail="start"), Recorder("relay", log, fail="stop")])
    with pytest.raises(KeyError), services:
        log.append("job")
        raise KeyError("the job's own exception passes through")
    assert log == ["start supervisor", "start relay", "job", "stop relay", "stop supervisor"]
    err = capsys.readouterr().err
    assert "distdebug: Recorder off (OSError: no terminal)" in err
    assert "distdebug: could not stop Recorder (RuntimeError: stuck)" in err


def test_a_supervisor_that_cannot_start_stops_the_launch():
    log: list[str] = []
    sup = Recorder("supervisor", log, fail="start")
    with pytest.raises(OSError), Services(sup, None, [sup, Recorder("relay", log)]):
        log.append("job")
    assert log == []
