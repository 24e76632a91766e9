"""Tier 1 (pure): environment checks on hosts described by hand."""

from __future__ import annotations

import os

from distdebug.doctor.checks import (
    FAIL,
    PASS,
    WARN,
    check_limits,
    check_master,
    check_topology,
    check_variables,
    interface_matches,
    parse_topology,
)

IFACES = ["lo", "eth0", "ib0", "docker0"]


def statuses(checks):
    return {c.name: c.status for c in checks}


def test_socket_interface_names_follow_nccl_and_gloo_rules():
    assert interface_matches("eth", IFACES, nccl=True) == ["eth0"]  # NCCL: a prefix
    assert interface_matches("=eth", IFACES, nccl=True) == []  # '=': exact
    assert interface_matches("^docker,lo", IFACES, nccl=True) == ["eth0", "ib0"]  # '^': all but these
    assert interface_matches("eth", IFACES, nccl=False) == []  # gloo: exact names
    assert interface_matches("lo,eth0", IFACES, nccl=False) == ["lo", "eth0"]


def test_dangerous_variables_are_flagged_with_reason_and_fix():
    env = {"GLOO_SOCKET_IFNAME": "enp5s0", "NCCL_SOCKET_IFNAME": "eth", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
           "TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_IB_DISABLE": "1", "NCCL_IB_TIMEOUT": "8",
           "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "86400"}
    checks = check_variables(env, IFACES, has_ib=True)
    assert statuses(checks) == {"GLOO_SOCKET_IFNAME": FAIL, "NCCL_SOCKET_IFNAME": PASS,
                                "TORCH_NCCL_ASYNC_ERROR_HANDLING": WARN, "TORCH_NCCL_BLOCKING_WAIT": WARN,
                                "NCCL_IB_DISABLE": WARN, "NCCL_IB_TIMEOUT": WARN,
                                "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": WARN}
    gloo = next(c for c in checks if c.name == "GLOO_SOCKET_IFNAME")
    assert "names no interface of this host (it has: lo, eth0, ib0, docker0)" in gloo.detail
    assert gloo.fix.startswith("set GLOO_SOCKET_IFNAME to one of eth0, ib0, docker0")
    assert all(c.fix for c in checks if c.status != PASS)
    # IB off on a host without IB is not a problem; nothing set, nothing said.
    assert check_variables({"NCCL_IB_DISABLE": "1"}, IFACES, has_ib=False) == []
    assert check_variables({}, IFACES, has_ib=True) == []


def test_master_limits_and_topology():
    assert statuses(check_master({"MASTER_PORT": "99999"}, check_port_free=False)) == {"MASTER_PORT": FAIL}
    assert statuses(check_master({"MASTER_ADDR": "localhost"}, check_port_free=False)) == {"MASTER_ADDR": PASS}
    assert statuses(check_master({"MASTER_ADDR": "no-such-host.invalid"}, False)) == {"MASTER_ADDR": FAIL}
    assert statuses(check_limits(64 << 20, 1024)) == {"/dev/shm": WARN, "open files": WARN}
    assert statuses(check_limits(16 << 30, 1 << 20)) == {"/dev/shm": PASS, "open files": PASS}
    topo = """\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tSYS\t0-31\t0
GPU1\tNV12\t X \tPHB\t0-31\t0
GPU2\tSYS\tPHB\t X \t32-63\t1
"""
    gpus, links = parse_topology(topo)
    assert gpus == ["GPU0", "GPU1", "GPU2"] and links[("GPU0", "GPU2")] == "SYS" and links[("GPU1", "GPU0")] == "NV12"
    (topology, mig) = check_topology(topo, ["Disabled", "Enabled", "Disabled"])
    assert topology.status == WARN and "GPU0-GPU2 (SYS), GPU1-GPU2 (PHB)" in topology.detail
    assert mig.status == WARN and "GPU(s) [1]" in mig.detail


def test_differences_across_ranks_and_slow_links():
    from distdebug.doctor.worker import compared_env, env_differences, slow_links

    env = compared_env({"NCCL_DEBUG": "INFO", "HOME": "/root", "NCCL_IB_HCA": "mlx5", "NCCL_API_KEY": "x"})
    assert env == {"NCCL_API_KEY": "<redacted>", "NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5"}
    ranks = {0: {"env": {"NCCL_DEBUG": "INFO"}, "versions": "torch 2.13"},
             1: {"env": {"NCCL_DEBUG": "INFO"}, "versions": "torch 2.13"},
             2: {"env": {"NCCL_DEBUG": "WARN", "NCCL_P2P_DISABLE": "1"}, "versions": "torch 2.12"}}
    assert env_differences(ranks) == [
        {"name": "NCCL_DEBUG", "values": {"INFO": [0, 1], "WARN": [2]}},
        {"name": "NCCL_P2P_DISABLE", "values": {"<unset>": [0, 1], "1": [2]}},
        {"name": "versions", "values": {"torch 2.13": [0, 1], "torch 2.12": [2]}},
    ]
    # The seed's case: cards 2 and 5 ten times slower than the rest.
    matrix = {(a, b): 20.0 for a in range(6) for b in range(a + 1, 6)}
    matrix[(2, 5)] = 2.0
    assert slow_links(matrix) == [(2, 5, 10.0)]
    assert slow_links({(0, 1): 1.0}) == []  # one link: nothing to compare with


def test_a_rank_checks_again_only_what_changed_since_its_launcher_checked():
    # attach's launcher checks once per node before the ranks start (a rank that fails at once cannot outrun
    # the explanation) and hands its ranks what it saw; a rank checks a variable only if its value changed
    # since: torch's agent setting the safe TORCH_NCCL_ASYNC_ERROR_HANDLING, or a fault spoiling a variable.
    import json

    from distdebug.detectors.env_check import changed_since, checked, node_findings, own_first_rank

    launcher = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "INFO", "PATH": "/bin", "MASTER_ADDR": "nowhere.invalid"}
    seen = json.dumps(checked(launcher))
    assert json.loads(seen) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "INFO"}  # what the checks read, only
    assert changed_since(seen, {**launcher, "RANK": "1", "MASTER_PORT": "x"}) == set()  # nothing to check again
    agent = {**launcher, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert changed_since(seen, agent) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    assert node_findings([0], agent, only={"TORCH_NCCL_ASYNC_ERROR_HANDLING"}) == []  # the agent's value is safe
    spoiled = {**launcher, "GLOO_SOCKET_IFNAME": "distdebug_missing0"}
    assert changed_since(seen, spoiled) == {"GLOO_SOCKET_IFNAME"}
    (f,) = node_findings([4], spoiled, only=changed_since(seen, spoiled))
    assert (f.detector, f.ranks, f.subject, f.severity.value) == ("env_check", [4], "GLOO_SOCKET_IFNAME", "error")
    assert changed_since(seen, {k: v for k, v in launcher.items() if k != "NCCL_DEBUG"}) == {"NCCL_DEBUG"}  # unset
    assert changed_since(None, launcher) is None and changed_since("not json", launcher) is None  # no launcher
    # MASTER_*: the agent sets the ranks' own from its rendezvous; the launcher's are not checked (doctor does)
    assert node_findings([0], launcher) == []
    # the launcher's findings, made before the rendezvous numbers the ranks, are filed after the job under the
    # global rank of the local rank 0 it started (its children: their parent pid), in the last attempt; another
    # launcher's ranks on the same host (two "nodes" on one machine, a c10d numbering) are not its own
    layout = {"0": {"local_rank": 0, "ppid": 11, "attempt": 0}, "1": {"local_rank": 1, "ppid": 11, "attempt": 0},
              "2": {"local_rank": 0, "ppid": 22, "attempt": 0}, "3": {"local_rank": 1, "ppid": 22, "attempt": 0}}
    assert (own_first_rank(layout, 11), own_first_rank(layout, 22), own_first_rank(layout, 33)) == (0, 2, None)
    restarted = {**layout, "0": {"local_rank": 0, "ppid": 22, "attempt": 1}, "2": {"local_rank": 0, "ppid": 11,
                                                                                   "attempt": 1}}
    assert own_first_rank(restarted, 11) == 2  # after a restart the rendezvous may number the nodes otherwise


def test_launcher_files_its_findings_under_rank_0_on_one_node_even_if_no_rank_recorded_its_start(tmp_path):
    # A rank that fails at once makes torch's agent stop the others: a local rank 0 still importing torch leaves
    # no start record. On one node its global rank is 0 all the same; on several the number is unknown then.
    from distdebug.artifacts import layout, schema
    from distdebug.artifacts.reader import read_events
    from distdebug.launch.attach import _file_env_findings

    rec = schema.record(schema.FINDING, severity="error", detector="env_check", ranks=[], step=None,
                        subject="GLOO_SOCKET_IFNAME", message="names no interface (host h)", fix="set it",
                        evidence={"host": "h"})
    for single, run, want in ((True, tmp_path / "one", [0]), (False, tmp_path / "two", [])):
        info = {"findings": [dict(rec)]}
        _file_env_findings(run, info, {}, single)
        (f,) = read_events(layout.run_findings_path(run))[0]
        assert (f["subject"], f["ranks"]) == ("GLOO_SOCKET_IFNAME", want) and "findings" not in info
    info = {"findings": [dict(rec)]}  # a recorded start wins over the default, on one node too
    _file_env_findings(tmp_path / "rec", info, {"3": {"local_rank": 0, "ppid": os.getpid(), "attempt": 0}}, True)
    assert read_events(layout.run_findings_path(tmp_path / "rec"))[0][0]["ranks"] == [3]
