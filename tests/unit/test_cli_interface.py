"""Tier 1: the command line is what tests/data/cli_interface.txt says, every command and option with its names,
type, default and choices (issue 63): a change to the interface is deliberate, made with the file written again
(``python -m tests.cli_interface --write``), and a reviewer sees it as a diff of that file."""

from __future__ import annotations

import difflib

from tests.cli_interface import FROZEN, current


def test_the_command_line_is_the_frozen_description():
    now, frozen = current(), FROZEN.read_text()
    diff = "".join(difflib.unified_diff(frozen.splitlines(True), now.splitlines(True), "frozen", "now", n=0))
    assert now == frozen, ("the command line changed; if on purpose, run python -m tests.cli_interface --write "
                           "and commit the file:\n" + diff)
    # what it holds: every command, and options of every kind (choices, flags, defaults, torchrun's own)
    for line in ("distdebug attach --fail-on ", "distdebug faults replay", "distdebug parity --launch-ref ",
                 "distdebug attach --nproc-per-node --nproc_per_node ", '"choices": ["warning", "error", "critical"]'):
        assert line in frozen, line
    assert len(frozen.splitlines()) > 100


def test_attach_help_leads_with_distdebugs_own_options_and_torchruns_follow():
    from click.testing import CliRunner

    from distdebug.cli import main

    text = CliRunner().invoke(main, ["attach", "--help"], terminal_width=120).output
    own, launcher = text.index("distdebug's options:"), text.index("torchrun's options")
    assert own < launcher
    for option in ("--run-dir", "--fail-on", "--inject", "--stall-timeout", "--detectors"):
        assert own < text.index(f"  {option} ") < launcher, option
    for option in ("--nproc-per-node", "--nnodes", "--master-port", "--max-restarts", "--log-dir"):
        assert text.index(f"  {option}") > launcher, option
    assert "\n  --no-python" not in text  # refused, and hidden from the options (the description says so)
