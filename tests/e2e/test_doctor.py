"""Tier 3 (CLI end to end): doctor on this host, and attach explaining a bad variable before the
script's own error."""

from __future__ import annotations

import json

from distdebug.artifacts import layout
from distdebug.artifacts.reader import read_events
from tests.helpers import RECIPES, distdebug, make_env


def test_doctor_fails_a_missing_socket_interface_and_passes_without_it():
    r = distdebug("doctor", "--json", env=make_env(GLOO_SOCKET_IFNAME="distdebug_missing0"))
    assert r.returncode == 1, r.output
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert checks["GLOO_SOCKET_IFNAME"]["status"] == "fail"
    assert "distdebug_missing0 names no interface of this host" in checks["GLOO_SOCKET_IFNAME"]["detail"]
    assert checks["versions"]["status"] == "pass" and "torch 2." in checks["versions"]["detail"]
    r = distdebug("doctor", env=make_env(GLOO_SOCKET_IFNAME="lo"))
    assert r.returncode == 0, r.output
    assert "GLOO_SOCKET_IFNAME" in r.stdout and "fail" not in r.stdout


def test_attach_explains_a_missing_socket_interface_before_the_raw_error(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path), str(RECIPES / "manual_allreduce.py"), "--steps", "2",
                  env=make_env(GLOO_SOCKET_IFNAME="distdebug_missing0"), timeout=120)
    assert r.returncode != 0
    first = r.stderr.index("env_check: GLOO_SOCKET_IFNAME: GLOO_SOCKET_IFNAME=distdebug_missing0 names no interface")
    assert "set GLOO_SOCKET_IFNAME to one of" in json.dumps(
        [x for x in read_events(layout.events_path(tmp_path, 0))[0] if x["kind"] == "finding"])
    assert first >= 0
