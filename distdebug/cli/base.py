"""The command group and what every command shares: one-line errors, bare groups that print their help,
sizes, the --fail-on gate and the run directories a command names.

Imports stay light (no torch): ``distdebug --help`` must answer in well under half a second."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from distdebug import envvars
from distdebug.artifacts.retention import parse_size
from distdebug.config import (
    EXIT_FINDINGS,
)
from distdebug.errors import UserError
from distdebug.findings import SEVERITY_MEANING

SEVERITIES_HELP = "Severities, least to most severe: " + "; ".join(
    f"{name}, {text.split(':')[0]}" for name, text in SEVERITY_MEANING.items()) + " (the docs' Findings page)."


class _Size(click.ParamType):
    """A size in bytes: 512K, 64M, 1G (binary units), a plain number of bytes, or 0."""

    name = "SIZE"

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        if isinstance(value, int):
            return value
        if str(value).strip() in ("0", "none", "off"):
            return 0
        try:
            return parse_size(str(value))
        except (ValueError, IndexError):
            self.fail(f"'{value}' is not a size: give e.g. 512K, 64M or 1G (0: no budget)", param, ctx)


SIZE = _Size()


class HelpfulGroup(click.Group):
    """A group that, called bare, prints its help and exits 0 (a question, not an error), and lists its
    commands with their whole first sentence (click cuts them at 45 characters with "...")."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args and not ctx.resilient_parsing:  # not under shell completion, which parses with no args
            click.echo(ctx.get_help())
            ctx.exit(0)
        return super().parse_args(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, cmd.get_short_help_str(limit=10_000)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class OneLineErrors(HelpfulGroup):
    """Usage and user errors as one line: what is wrong and what to do; never a traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        try:
            rv = super().main(args=args, prog_name=prog_name or "distdebug", complete_var=complete_var,
                              standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            print("distdebug: aborted", file=sys.stderr)
            sys.exit(130)
        except click.UsageError as e:
            path = e.ctx.command_path if e.ctx else "distdebug"
            print(f"distdebug: error: {e.format_message().rstrip('.')}; see '{path} --help'", file=sys.stderr)
            sys.exit(2)
        except click.ClickException as e:
            print(f"distdebug: error: {e.format_message()}", file=sys.stderr)
            sys.exit(e.exit_code)
        except UserError as e:
            print(f"distdebug: error: {e}", file=sys.stderr)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            sys.exit(130)
        except Exception as e:
            if envvars.get(envvars.DEBUG):
                raise
            print(f"distdebug: internal error: {type(e).__name__}: {e} "
                  "(distdebug's own bug: rerun with DISTDEBUG_DEBUG=1 for the traceback and report it; what to "
                  "send: the docs' Contributing page, Reporting a problem)", file=sys.stderr)
            sys.exit(70)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="distdebug", message="distdebug %(version)s")
def main() -> None:
    """distdebug: which rank, which step, which tensor broke your distributed training, and what to do."""



def gate(findings: list, fail_on: str | None) -> int:
    """``--fail-on``: EXIT_FINDINGS and one line when a finding at or above the level is there, else 0."""
    from distdebug.findings import at_or_above, gate_line

    failing = at_or_above(findings, fail_on) if fail_on else []
    if failing:
        assert fail_on is not None
        print(f"distdebug: {gate_line(fail_on, failing)}; exit {EXIT_FINDINGS}", file=sys.stderr)
        return EXIT_FINDINGS
    return 0



def run_dirs(runs: tuple[str, ...]) -> list[Path]:
    """The run directories RUN ... name (paths, or names under ./distdebug-runs), or the newest run."""
    from distdebug.artifacts.runs import resolve_run

    return [resolve_run(r) for r in runs] if runs else [resolve_run(None)]
