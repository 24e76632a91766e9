"""torchrun's options that ``attach`` does not handle itself: handed to torch's launcher, or refused.

``distdebug attach`` stands in for ``torchrun`` in a launch script, so a torchrun command line must
parse unchanged. Every option of torch's parser (``torch.distributed.run.get_args_parser``) is one of:
attach's own (the launcher options it needs the values of: ranks, nodes, rendezvous, ``-m``; in
distdebug/cli/cmd_attach.py), one of the options below, passed to ``torch.distributed.run`` as typed (torchrun's
meaning, torch's own code doing it), already what attach does, or refused with one line saying why.
tests/unit/test_torchrun_options.py enumerates torch's parser: an option that torch adds is a failing
test, not a user's launch line failing at option parsing.

Torch-free on purpose: the click app builds its options from this table and ``distdebug --help`` must
not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PASS: Literal["pass"] = "pass"
ALREADY: Literal["already"] = "already"
REFUSE: Literal["refuse"] = "refuse"


@dataclass(frozen=True)
class TorchrunOption:
    names: tuple[str, ...]
    """Every spelling torchrun accepts, the canonical one first (as torch's parser lists them)."""
    help: str
    use: Literal["pass", "already", "refuse"] = PASS
    """pass: handed to torch's launcher unchanged; already: what attach does anyway, nothing to hand over;
    refuse: attach stops with ``help`` as the reason."""
    flag: bool = False
    """Takes no value (torch's ``check_env`` options)."""
    type: type = str
    """int, float or str: checked before any rank starts (torch's argparse would exit with its own usage)."""
    choices: tuple[str, ...] = ()
    env: bool = True
    """torchrun reads ``PET_<DEST>`` as its default (torch's ``env``/``check_env`` actions); attach does too."""

    @property
    def dest(self) -> str:
        """argparse's: the first long name, dashes as underscores (``-t, --tee``: tee)."""
        return next(n for n in self.names if n.startswith("--"))[2:].replace("-", "_")

    @property
    def param(self) -> str:
        """The click parameter's name: prefixed, so that attach tells these from its own options."""
        return PREFIX + self.dest

    @property
    def envvar(self) -> str | None:
        return f"PET_{self.dest.upper()}" if self.env else None


PREFIX = "torchrun_"

_LOG_FORMAT = "3 both, 1 stdout, 2 stderr, or per local rank, e.g. 0:3,1:2"

OPTIONS: tuple[TorchrunOption, ...] = (
    TorchrunOption(("--log-dir", "--log_dir"), "torchrun's: base directory of the ranks' log files (a sub-directory "
                   "per job and attempt, one folder per local rank; with -r/-t). distdebug's records still go "
                   "to the run directory."),
    TorchrunOption(("-r", "--redirects"), f"torchrun's: the ranks' std streams into log files only ({_LOG_FORMAT})."),
    TorchrunOption(("-t", "--tee"), f"torchrun's: the ranks' std streams into log files and to the console, lines "
                   f"prefixed [role+local rank] ({_LOG_FORMAT})."),
    TorchrunOption(("--local-ranks-filter", "--local_ranks_filter"),
                   "torchrun's: show only these local ranks' output on the console, e.g. 0 or 0,1 (log files keep "
                   "every rank's)."),
    TorchrunOption(("--duplicate-stdout-filters", "--duplicate_stdout_filters"),
                   "torchrun's: copy the ranks' stdout lines matching any of these comma-separated filters to "
                   "another file."),
    TorchrunOption(("--duplicate-stderr-filters", "--duplicate_stderr_filters"),
                   "torchrun's: the same for stderr."),
    TorchrunOption(("--monitor-interval", "--monitor_interval"), "torchrun's: seconds between the agent's checks of "
                   "its workers.", type=float),
    TorchrunOption(("--start-method", "--start_method"), "torchrun's: multiprocessing start method (workers started "
                   "as a program, as attach's are, do not use it).", choices=("spawn", "fork", "forkserver")),
    TorchrunOption(("--event-log-handler", "--event_log_handler"), "torchrun's: a registered event logging handler."),
    TorchrunOption(("--role",), "torchrun's: the workers' role (ROLE_NAME; the prefix of -t lines)."),
    TorchrunOption(("--local-addr", "--local_addr"), "torchrun's: this node's address for the rendezvous."),
    TorchrunOption(("--logs-specs", "--logs_specs"), "torchrun's: a torchrun.logs_specs entry point for custom "
                   "logging.", env=False),
    TorchrunOption(("--numa-binding", "--numa_binding"), "torchrun's: bind workers to CPUs near their GPUs.",
                   choices=("node", "socket", "exclusive", "core-complex"), env=False),
    TorchrunOption(("--signals-to-handle", "--signals_to_handle"), "torchrun's: signals the agent forwards to the "
                   "workers, comma-separated."),
    TorchrunOption(("--shutdown-timeout", "--shutdown_timeout"), "torchrun's: seconds for workers to stop before "
                   "SIGKILL.", type=int),
    TorchrunOption(("--virtual-local-rank", "--virtual_local_rank"), "torchrun's: LOCAL_RANK 0 in every worker, each "
                   "seeing its own GPU as device 0.", flag=True),
    TorchrunOption(("--run-path", "--run_path"), "torchrun's; accepted as is: attach always runs SCRIPT with "
                   "runpy.run_path in each rank's own interpreter.", use=ALREADY, flag=True),
    TorchrunOption(("--no-python", "--no_python"), "distdebug instruments SCRIPT inside each rank's Python "
                   "interpreter, so a program started without python cannot be attached: give the Python script "
                   "it starts, or run it under torchrun", use=REFUSE, flag=True),
)


def argv(values: dict[str, object]) -> list[str]:
    """torchrun arguments for the passed options given a value ({dest: value}; None or False: not given)."""
    out: list[str] = []
    for opt in OPTIONS:
        value = values.get(opt.dest)
        if opt.use != PASS or value is None or value is False:
            continue
        name = "--" + opt.dest.replace("_", "-")  # the long spelling: the manifest reads as torchrun's docs
        out += [name] if opt.flag else [name, str(value)]
    return out
