"""What distdebug knows without a run: ``detectors``, ``explain``, ``doctor``, ``lint``."""

from __future__ import annotations

from pathlib import Path

import click

from distdebug import strictjson
from distdebug.cli.base import main
from distdebug.errors import UserError


@main.command("detectors", short_help="List the detectors: code, name, on by default or not, what each finds.")
@click.option("--options", "with_options", is_flag=True,
              help="Also list each detector's --detector-option keys, their defaults and meaning.")
def list_detectors(with_options: bool) -> int:
    """List the registered detectors: code, name, on by default or not, what it finds."""
    from distdebug import cards
    from distdebug.detectors import registry

    for name in registry.names():  # the registry's names, each read from its card (a test keeps them paired)
        card = cards.CARDS[name]
        click.echo(f"{card.code}  {name:22s} {'default' if card.default else 'opt-in ':8s} {card.title}")
        if with_options:
            for o in card.options:
                flag = f" (attach {o.flag})" if o.flag else ""
                click.echo(f"        --detector-option {name}.{o.key}=... default {o.default!r}{flag}: {o.help}")
    return 0


@main.command(short_help="What a finding means: its causes, the check and the fix.")
@click.argument("code_or_name", required=False)
def explain(code_or_name: str | None) -> int:
    """What a finding means, its likely causes, the check and the fix: CODE_OR_NAME is a finding's code (DD102)
    or its detector (nan_origin); none: every finding kind."""
    from distdebug import cards
    from distdebug.report import cardview

    if code_or_name is None:
        for card in cards.CARDS.values():
            click.echo(f"{card.code}  {card.name:22s} {card.title}")
        return 0
    found = cards.lookup(code_or_name)
    if found is None:
        raise UserError(f"no finding kind '{code_or_name}': give a code (DD101) or a name (nan_origin); "
                        "'distdebug explain' lists them", 2)
    click.echo(cardview.text(found))
    return 0


@main.command(short_help="Check the environment for distributed training, across ranks and nodes.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--bandwidth", is_flag=True, help="Also an all_reduce bandwidth sweep and a pairwise link matrix "
              "across the ranks (started like attach).")
@click.option("--nproc-per-node", "--nproc_per_node", "nproc_per_node", default=None,
              help="Check across this many ranks per node, started like attach (default with --bandwidth: "
                   "as attach). Without it and --bandwidth: this host only, no ranks.")
@click.option("--nnodes", default="1", show_default=True, help="Nodes: N or MIN:MAX.")
@click.option("--node-rank", "--node_rank", "node_rank", type=int, default=0, show_default=True,
              help="This node's rank (static rendezvous), as attach.")
@click.option("--rdzv-backend", "--rdzv_backend", "rdzv_backend", default="static", show_default=True,
              help="Rendezvous backend: static or c10d, as attach.")
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", default="",
              help="Rendezvous HOST:PORT, as attach.")
@click.option("--master-addr", "--master_addr", "master_addr", default=None,
              help="Static rendezvous address, as attach.")
@click.option("--master-port", "--master_port", "master_port", type=int, default=None,
              help="Static rendezvous port, as attach.")
@click.option("--max-bytes", type=int, default=128 << 20, show_default=True,
              help="Largest all_reduce of the sweep (bytes; from 8 B, doubling).")
@click.option("--run-dir", type=click.Path(path_type=Path), default=None,
              help="Where the ranks' records go. Default: a new directory under ./distdebug-runs/.")
def doctor(as_json: bool, bandwidth: bool, nproc_per_node: str | None, max_bytes: int, run_dir: Path | None,
           **launcher: object) -> int:
    """Check the environment for distributed training: versions, GPUs and topology, dangerous
    NCCL/GLOO/MASTER variables, port, /dev/shm, open-file limit; across ranks and nodes, differences in
    variables and versions; with --bandwidth, bus bandwidth and the link matrix. Exits 1 on a fail."""

    from distdebug.doctor.checks import FAIL, local_checks

    if nproc_per_node is None and not bandwidth:
        checks = [c.to_dict() for c in local_checks()]
        result: dict = {"ranks": {"local": {"checks": checks}}, "differences": []}
        failed = any(c["status"] == FAIL for c in checks)
    else:
        from distdebug.launch.doctor import run_doctor

        result, failed = run_doctor(nproc_per_node=nproc_per_node, bandwidth=bandwidth, max_bytes=max_bytes,
                                    run_dir=run_dir, launcher=launcher)
    if as_json:
        click.echo(strictjson.dumps(result, indent=2))
    else:
        from rich.console import Console

        from distdebug.report.doctor_view import render

        out = Console()
        render(out if out.is_terminal else Console(width=160), result)
    return 1 if failed else 0


@main.command(short_help="DDP, FSDP and DeepSpeed pitfalls in a script's source (nothing runs).")
@click.argument("script", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def lint(script: Path, as_json: bool) -> int:
    """DDP, FSDP and DeepSpeed pitfalls in SCRIPT, read from its source (nothing runs): file:line, why it
    matters, the fix. Exits 1 if any is an error."""

    from distdebug.errors import UserError
    from distdebug.lint.static import ERROR, lint_file

    if not script.is_file():
        raise UserError(f"script not found: {script}", 2)
    findings = lint_file(script)
    if as_json:
        click.echo(strictjson.dumps([f.to_dict() for f in findings], indent=2))
    else:
        for f in findings:
            click.echo(f"{script}:{f.line}: {f.severity} [{f.rule}] {f.message}\n    why: {f.why}\n    fix: {f.fix}")
        click.echo(f"{len(findings)} finding(s) in {script}" if findings else f"no pitfalls found in {script}")
    return 1 if any(f.severity == ERROR for f in findings) else 0
