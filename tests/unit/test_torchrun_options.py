"""Tier 1 (no ranks started): ``distdebug attach`` takes torchrun's command line (issue 45, item 6).

torch's own parser (``torch.distributed.run.get_args_parser``) is enumerated, so that an option a new
torch adds, which attach neither takes nor refuses with a reason, fails here rather than a user's
launch script; and a torchrun command line handed through attach reaches torch's launcher with the
same meaning (the namespace torch parses from attach's launcher argv equals the one it parses from
the line itself). The launch itself (log files, console filter, findings) is tests/e2e/test_torchrun_options.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import click
import pytest
import torch.distributed.run as torchrun
from torch.distributed.argparse_util import check_env, env

from distdebug.cli import main
from distdebug.config import AttachConfig
from distdebug.launch import attach as attach_mod
from distdebug.launch import torchrun_options
from distdebug.launch.attach import BOOTSTRAP_MODULE, AttachResult, torchrun_argv

# A value per torchrun option, unlike torch's default so that a value lost on the way shows (None: a flag).
# A new torch option needs one here: the test below names it.
SAMPLES: dict[str, str | None] = {
    "nnodes": "2", "nproc_per_node": "3", "rdzv_backend": "c10d", "rdzv_endpoint": "10.0.0.1:29400",
    "rdzv_id": "job7", "rdzv_conf": "join_timeout=60,read_timeout=30", "max_restarts": "2",
    "monitor_interval": "0.5", "start_method": "fork", "event_log_handler": "console", "role": "trainer",
    "log_dir": "/tmp/torchrun-logs", "redirects": "0:3,1:2", "tee": "3", "local_ranks_filter": "0",
    "duplicate_stdout_filters": "loss,,step,grad", "duplicate_stderr_filters": "Error", "node_rank": "1",
    "master_addr": "10.0.0.1", "master_port": "1234", "local_addr": "10.0.0.2", "logs_specs": "custom",
    "numa_binding": "socket", "signals_to_handle": "SIGTERM,SIGUSR1", "shutdown_timeout": "7",
    "virtual_local_rank": None,
}
# Options a single line cannot hold with the rest (--standalone is for one node), each tried on its own line;
# and the ones with nothing to hand to torch (run_path: what attach does; no_python: refused; module: the
# bootstrap is always a module), checked by name below.
OWN_LINE = {"standalone", "module", "run_path"}
NOT_HANDED = {"module", "run_path", "no_python"}


def torch_actions() -> list[argparse.Action]:
    return [a for a in torchrun.get_args_parser()._actions if a.option_strings and a.dest != "help"]


def attach_options() -> dict[str, click.Option]:
    command = main.commands["attach"]
    assert isinstance(command, click.Command)
    return {name: p for p in command.params if isinstance(p, click.Option) for name in p.opts}


def test_every_torchrun_option_is_taken_with_its_meaning_or_refused_with_a_reason():
    options = attach_options()
    actions = torch_actions()
    assert len(actions) >= 29  # torch 2.13's parser is really read
    unknown = [s for a in actions for s in a.option_strings if s not in options]
    assert unknown == [], f"torchrun options attach neither takes nor refuses: {unknown} (launch/torchrun_options.py)"
    for a in actions:
        p = options[a.option_strings[0]]
        assert set(a.option_strings) <= set(p.opts), (a.option_strings, p.opts)  # every spelling, one option
        assert p.is_flag == (a.nargs == 0), a.dest
        # PET_*: attach reads each variable torchrun reads, and no other
        assert p.envvar == (f"PET_{a.dest.upper()}" if isinstance(a, env | check_env) else None), a.dest
        if a.choices:
            assert isinstance(p.type, click.Choice) and list(p.type.choices) == list(a.choices), a.dest
        if a.type in (int, float):
            assert p.type == click.types.convert_type(a.type), a.dest
        if p.hidden:  # refused: the reason is what the user reads
            assert p.help and "\n" not in p.help and len(p.help) > 40, a.dest


def test_torchrun_options_table_spells_like_torch():
    by_dest = {a.dest: a for a in torch_actions()}
    for opt in torchrun_options.OPTIONS:
        assert opt.dest in by_dest, f"{opt.names} is not a torchrun option"
        assert opt.names == tuple(by_dest[opt.dest].option_strings), opt.names  # canonical name first


def _attach_cfg(line: list[str], monkeypatch: pytest.MonkeyPatch) -> AttachConfig:
    """The AttachConfig the click app builds from ``distdebug attach LINE`` (the launch itself is not run)."""
    seen: list[AttachConfig] = []

    def launch(cfg: AttachConfig, argv: list[str] | None = None) -> AttachResult:
        seen.append(cfg)
        return AttachResult(0, Path("run"))

    monkeypatch.setattr(attach_mod, "attach", launch)
    with pytest.raises(SystemExit) as exit_:
        main.main(["attach", *line])
    assert exit_.value.code == 0 and len(seen) == 1
    return seen[0]


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(name)  # the lines below say everything
    path = tmp_path / "train.py"
    path.write_text("")
    return path


def _line(dests: list[str]) -> list[str]:
    by_dest = {a.dest: a for a in torch_actions()}
    out: list[str] = []
    for dest in dests:
        value = SAMPLES[dest] if dest in SAMPLES else None
        out += [by_dest[dest].option_strings[-1]] + ([] if value is None else [value])  # the underscore spelling
    return out


def _same_meaning(line: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[argparse.Namespace, AttachConfig]:
    theirs = torchrun.parse_args(line)
    cfg = _attach_cfg(line, monkeypatch)
    ours = torchrun.parse_args(torchrun_argv(cfg, cfg.nproc_per_node or "2"))
    for dest, value in vars(theirs).items():
        if dest not in NOT_HANDED | {"training_script", "training_script_args"}:
            mine = getattr(ours, dest)
            if dest == "nnodes":  # attach's default "1" is torchrun's "1:1"
                mine, value = torchrun.parse_min_max_nnodes(mine), torchrun.parse_min_max_nnodes(value)
            assert mine == value, (dest, mine, value)
    assert ours.module and ours.training_script == BOOTSTRAP_MODULE
    return theirs, cfg


def test_a_torchrun_line_means_the_same_to_torchs_launcher_through_attach(script, monkeypatch):
    dests = [a.dest for a in torch_actions() if a.dest not in OWN_LINE | NOT_HANDED]
    missing = [d for d in dests if d not in SAMPLES]
    assert missing == [], f"give torchrun's new option a sample value in SAMPLES: {missing}"
    line = _line(dests) + [str(script), "--lr", "0.1", "--log-dir", "script's own"]
    theirs, cfg = _same_meaning(line, monkeypatch)
    assert theirs.training_script_args == ["--lr", "0.1", "--log-dir", "script's own"]
    assert cfg.target_args == theirs.training_script_args  # after SCRIPT, everything is the script's
    assert torchrun_options.argv({}) == []  # nothing typed: torch's own defaults, not copies of them here


@pytest.mark.parametrize("flag", ["--standalone", "--run-path", "-m"])
def test_the_flags_of_one_node(flag, script, monkeypatch):
    target = "mypkg.train" if flag == "-m" else str(script)
    theirs, cfg = _same_meaning(["--nproc-per-node", "2", flag, target, "--epochs", "1"], monkeypatch)
    assert cfg.module == (flag == "-m") and cfg.target_args == ["--epochs", "1"]
    assert cfg.torchrun_args == []  # --run-path: the bootstrap runs SCRIPT with runpy.run_path anyway


def test_torchruns_pet_variables_are_read_for_the_options_handed_through(script, monkeypatch):
    monkeypatch.setenv("PET_TEE", "3")
    monkeypatch.setenv("PET_LOG_DIR", "/tmp/logs")
    monkeypatch.setenv("PET_VIRTUAL_LOCAL_RANK", "1")
    _, cfg = _same_meaning(["--nproc-per-node", "2", str(script)], monkeypatch)
    # typed into the launcher argv, so that the manifest records them
    assert cfg.torchrun_args == ["--log-dir", "/tmp/logs", "--tee", "3", "--virtual-local-rank"]
    monkeypatch.setenv("PET_TEE", "1")
    # the command line wins, as in torchrun
    _, cfg = _same_meaning(["--nproc-per-node", "2", "--tee", "2", str(script)], monkeypatch)
    assert "2" in cfg.torchrun_args


@pytest.mark.parametrize("how", ["--no-python", "--no_python", "PET_NO_PYTHON=1"])
def test_no_python_is_refused_in_one_line_saying_why(how, script, monkeypatch, capsys):
    line = [str(script)]
    if how.startswith("PET_"):
        monkeypatch.setenv(*how.split("="))
    else:
        line = [how, *line]
    with pytest.raises(SystemExit) as exit_:
        main.main(["attach", *line])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("distdebug: error: --no-python: ") and "instruments SCRIPT inside each rank's Python" in err
