"""Per-rank entry point: install the instrumentation, then run the user's script as ``__main__``.

torch's elastic agent starts each worker as ``python -u -m distdebug.launch.bootstrap TARGET ARGS``.
If instrumentation fails to start, the script still runs (uninstrumented) and the reason is
printed: the harness must never be the reason a training job does not run.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path

from distdebug import envvars


def _start_session():  # -> Session | None
    from distdebug.artifacts import layout, retention
    from distdebug.artifacts.writer import RESERVE, EventWriter, os_error_text
    from distdebug.context import RankIdentity
    from distdebug.detectors import registry
    from distdebug.runtime.session import Session

    identity = RankIdentity.from_env()
    run_dir_s = envvars.get(envvars.RUN_DIR)
    run_dir = Path(run_dir_s) if run_dir_s else None
    writer = None
    rank_dir = None
    if run_dir is not None:
        rank_dir = layout.rank_dir(run_dir, identity.rank)
        try:
            writer = EventWriter(layout.events_path(run_dir, identity.rank), reserve=RESERVE,
                                 label=f"rank {identity.rank}", share=retention.rank_shares()[0], index=True)
        except OSError as e:  # a full or read-only run directory: the checks still run, their findings on stderr
            _say(f"distdebug: rank {identity.rank}: cannot write the run directory ({os_error_text(e)}): this rank's "
                 "records are off; its checks run and print their findings here")
    detectors = registry.build_injected(envvars.get(envvars.INJECT)) + \
        registry.build(envvars.decode_specs(envvars.get(envvars.DETECTORS)))
    session = Session(identity, writer, detectors, run_dir=run_dir, rank_dir=rank_dir)
    if run_dir is not None:
        import faulthandler

        from distdebug.artifacts.inflight import InflightSlot

        try:  # where a crash leaves no record: the collective the rank was inside, its stacks
            session.inflight = InflightSlot(layout.inflight_path(run_dir, identity.rank))
            # A rank that dies by a fatal signal (gloo aborts on a collective size mismatch) runs no
            # Python again; faulthandler writes every thread's stack from its C-level handler.
            global _CRASH_FILE
            _CRASH_FILE = open(layout.crash_path(run_dir, identity.rank), "w")  # noqa: SIM115 (open for the process life)
            faulthandler.enable(file=_CRASH_FILE, all_threads=True)
        except OSError as e:
            if writer is not None:  # the events' failure was said already
                _say(f"distdebug: rank {identity.rank}: cannot write the run directory ({os_error_text(e)}): a "
                     "crash of this rank will not be told from its last collective")
    session.install()
    if envvars.get(envvars.DETERMINISTIC) == "1":
        _deterministic()
    return session


def _deterministic() -> None:
    """--deterministic: every generator seeded with 0 and torch's deterministic algorithms on, before
    the script runs (the script may still seed on its own; CUBLAS_WORKSPACE_CONFIG is set by attach)."""
    import random

    import torch

    random.seed(0)
    try:
        import numpy

        numpy.random.seed(0)
    except ImportError:
        pass
    torch.manual_seed(0)  # CPU and every CUDA device
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


_CRASH_FILE = None


def _say(line: str) -> None:
    """One line on stderr; a closed or full stderr (a file on the same full disk) never stops the script."""
    try:
        print(line, file=sys.stderr, flush=True)
    except Exception:
        pass


def _collective_in_traceback(exc: BaseException) -> str | None:
    """The torch.distributed function an exception came out of (``all_reduce``...), if any."""
    name = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        if os.path.basename(frame.f_code.co_filename) == "distributed_c10d.py":
            name = frame.f_code.co_name
    return name


def _record_script_error(session, exc: BaseException) -> None:
    """The script_error record; when a collective raised, also the stacks and Flight Recorder dump."""
    from distdebug.artifacts import layout, schema
    from distdebug.runtime.watchdog import flight_recorder_dump, frames_of

    collective = _collective_in_traceback(exc)
    frames = frames_of(traceback.extract_tb(exc.__traceback__))
    fr = False
    if collective is not None and session.ctx.run_dir is not None:
        dump = flight_recorder_dump()
        if dump is not None:
            try:  # the error record below matters more than the dump
                layout.fr_trace_path(session.ctx.run_dir, session.identity.rank).write_bytes(dump)
                fr = True
            except OSError:
                pass
    session.emit(
        schema.record(
            schema.SCRIPT_ERROR,
            rank=session.identity.rank,
            step=session.step,
            exception=type(exc).__name__,
            message=str(exc)[:2000],
            collective=collective,
            stack=frames[-12:],
            flight_recorder=fr,
            **_unused_parameters(session, exc),
        )
    )


def _unused_parameters(session, exc: BaseException) -> dict:
    """DDP's "did not receive grad" error gives parameter indices; the live model gives their names.

    DDP numbers the parameters it reduces in the order of ``module.named_parameters()``, keeping those
    that require gradients and are not in ``parameters_to_ignore``.
    """
    from distdebug.analysis.errors import unused_indices

    indices = unused_indices(str(exc))
    if not indices:
        return {}
    try:
        from torch.nn.parallel import DistributedDataParallel

        for root in session.roots:
            if isinstance(root, DistributedDataParallel):
                ignore = set(getattr(root, "parameters_to_ignore", ()) or ())
                names = [n for n, p in root.module.named_parameters() if p.requires_grad and n not in ignore]
                return {"unused_parameters": {str(r): [names[i] if i < len(names) else str(i) for i in idx]
                                              for r, idx in indices.items()}}
    except Exception:  # naming is a convenience; the indices stay in the message
        pass
    return {}


def _print_script_traceback(exc: BaseException) -> None:
    """The script's traceback as Python would print it, without runpy's frames or distdebug's.

    distdebug's frames (the bootstrap, the collective wrappers) would make the user's error look
    like ours; they are left out of every exception in the chain.
    """
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the distdebug package

    def hidden(filename: str) -> bool:
        path = os.path.abspath(filename)
        return filename == "<frozen runpy>" or path == os.path.abspath(runpy.__file__) or \
            path.startswith(ours + os.sep)

    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen: set[int] = set()
    todo = [te]
    while todo:
        cur = todo.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        cur.stack = traceback.StackSummary.from_list([f for f in cur.stack if not hidden(f.filename)])
        todo += [t for t in (cur.__cause__, cur.__context__) if t is not None]
    sys.stderr.write("".join(te.format()))
    sys.stderr.flush()


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def main() -> None:
    if len(sys.argv) < 2:
        print("distdebug bootstrap: no target given (this module is started by 'distdebug attach')",
              file=sys.stderr)
        sys.exit(2)
    target, args = sys.argv[1], sys.argv[2:]
    is_module = envvars.get(envvars.TARGET_IS_MODULE) == "1"
    session = None
    watchdog = None
    try:
        session = _start_session()
    except Exception as e:  # instrumentation must never stop training
        _say(f"distdebug: instrumentation off on this rank: {type(e).__name__}: {e}")
    if session is not None:
        from distdebug.config import AttachConfig, option_default, startup_allowance
        from distdebug.runtime.watchdog import RankWatchdog

        stall = float(envvars.get(envvars.STALL_TIMEOUT) or option_default(AttachConfig, "stall_timeout"))
        startup = float(envvars.get(envvars.STARTUP_TIMEOUT) or startup_allowance(stall))
        watchdog = RankWatchdog(session, stall, startup_timeout=startup,
                                watch_parent=envvars.get(envvars.PARENT_WATCH, "1") != "0")
        watchdog.start()

    sys.argv = [target, *args]
    code = 0
    try:
        if is_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:
        _print_script_traceback(e)
        code = 1
        if session is not None:
            try:
                _record_script_error(session, e)
            except Exception as err:
                _say(f"distdebug: could not record the script's error: {err}")
    finally:
        if session is not None:
            try:
                session.close(code)
            except Exception as e:
                _say(f"distdebug: could not close the session cleanly: {e}")
        if watchdog is not None:
            watchdog.stop()
    sys.exit(code)


if __name__ == "__main__":
    main()
