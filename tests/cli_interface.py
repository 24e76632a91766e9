"""The whole command line, frozen: every command, argument and option with its names, type, default and
choices, as ``tests/data/cli_interface.txt`` holds it (a line
per parameter: a change reads as a one-line diff) (issue 63).

Why: users put distdebug's commands in scripts and CI files; a renamed option or a changed default breaks them
silently. ``tests/unit/test_cli_interface.py`` compares the CLI with the file, so that a change to the interface
is made on purpose: change the code, then write the file again and commit both
(``python -m tests.cli_interface --write``). torchtitan holds its configuration the same way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

FROZEN = Path(__file__).resolve().parent / "data" / "cli_interface.txt"


def _param(p: click.Parameter) -> dict[str, Any]:
    kind = p.type
    out: dict[str, Any] = {"names": [*p.opts, *p.secondary_opts], "kind": p.param_type_name,
                           "type": kind.name if not isinstance(kind, click.Choice) else "choice"}
    if isinstance(kind, click.Choice):
        out["choices"] = [str(c) for c in kind.choices]
    default = p.default  # click 8.2 marks "no default" with a sentinel of its own: None here, for any click
    out["default"] = default if default is None or isinstance(default, (bool, int, float, str)) else (
        None if "sentinel" in type(default).__name__.lower() or "UNSET" in str(default) else str(default))
    if isinstance(p, click.Option):
        out.update(flag=p.is_flag, multiple=p.multiple, hidden=p.hidden, envvar=p.envvar)
    else:
        out.update(required=p.required, nargs=p.nargs)
    return out


def describe(cmd: click.Command, name: str = "distdebug") -> dict[str, Any]:
    """``cmd`` and, for a group, each of its commands, recursively."""
    out: dict[str, Any] = {"name": name, "params": [_param(p) for p in cmd.params if p.name != "help"]}
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        out["commands"] = [describe(sub, f"{name} {n}") for n in cmd.list_commands(ctx)
                           if (sub := cmd.get_command(ctx, n)) is not None]
    return out


def lines(d: dict[str, Any]) -> list[str]:
    """A line per command and per parameter: ``distdebug attach --run-dir {...}``."""
    out = [d["name"]]
    for p in d["params"]:
        rest = json.dumps({k: v for k, v in p.items() if k != "names"}, sort_keys=True)
        out.append(f"{d['name']} {' '.join(p['names']) or p['kind']} {rest}")
    for sub in d.get("commands", []):
        out += lines(sub)
    return out


def current() -> str:
    from distdebug.cli import main

    return "\n".join(lines(describe(main))) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.cli_interface --write  (after a deliberate change to the command line)")
    FROZEN.write_text(current())
    print(f"wrote {FROZEN}")
