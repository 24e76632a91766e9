"""The ranks' PyTorch Flight Recorder dumps, matched across ranks by PyTorch's own analyzer.

Matching is ``torch.distributed.flight_recorder``'s (fr_trace); gloo dumps are normalised for it
first (torch 2.13 keys gloo's default group as ``''`` in ``pg_config`` but ``'0'`` in the entries).
Part of loading: its result is one plain dict in ``HangFacts``, judged with the rest.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import tempfile
from pathlib import Path
from typing import Any

from distdebug.artifacts import layout
from distdebug.artifacts.reader import Run


def _normalise_dump(dump: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Make a gloo dump readable by torch's analyzer; drop the harness's own group's collectives."""
    from distdebug.runtime.exchange import HARNESS_GROUP_DESC

    dump["entries"] = [e for e in dump.get("entries", [])
                       if HARNESS_GROUP_DESC not in str(e.get("process_group", ("", ""))[1])]
    config = dict(dump.get("pg_config") or {})
    everyone = str(list(range(world_size)))
    default = config.get("") or {}
    ranks = default.get("ranks") if default.get("ranks") not in (None, "", "[]") else everyone
    for entry in dump.get("entries", []):
        name, desc = entry.get("process_group", ("", ""))
        if name not in config:
            config[name] = {"name": name, "desc": desc, "ranks": ranks}
    dump["pg_config"] = config
    return dump


def flight_recorder_verdict(run: Run, world_size: int) -> dict[str, Any] | None:
    """First collective that PyTorch's analyzer finds with missing ranks or a mismatch, or None.

    The dict: seq, op, process_group, input_sizes, missing_ranks, mismatch (None or torch's words),
    expected_ranks, frames (the collective's call stack, outermost first); ``{"error": ...}`` when the
    analyzer failed on the dumps.
    """
    dumps = {r: layout.fr_trace_path(run.dir_of(r), r) for r in run.ranks
             if layout.fr_trace_path(run.dir_of(r), r).exists()}
    if not dumps:
        return None
    try:
        # torch's analyzer prints "tabulate is not installed" on import; that is not the user's business.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from torch.distributed.flight_recorder.components.builder import build_db
            from torch.distributed.flight_recorder.components.config_manager import JobConfig
            from torch.distributed.flight_recorder.components.loader import read_dir
    except ImportError:
        return None
    fr_logger = logging.getLogger("Flight Recorder")
    old_level, old_prop = fr_logger.level, fr_logger.propagate
    fr_logger.setLevel(logging.CRITICAL)
    fr_logger.propagate = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rank, path in dumps.items():
                dump = _normalise_dump(pickle.loads(path.read_bytes()), world_size)
                (Path(tmp) / f"rank_{rank}").write_bytes(pickle.dumps(dump))
            argv = [tmp, "-p", "rank_"]
            if len(dumps) < world_size:
                argv.append("--allow-incomplete-ranks")
            args = JobConfig().parse_args(argv)
            details, version = read_dir(args)
            db = build_db(details, args, version)
    except Exception as e:  # a torch-internal format change must not hide the rest of the diagnosis
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        fr_logger.setLevel(old_level)
        fr_logger.propagate = old_prop
    for c in db.collectives:
        if c.missing_ranks or c.type_of_mismatch:
            return {
                "seq": c.collective_seq_id, "op": c.collective_name, "process_group": c.pg_desc,
                "input_sizes": c.input_sizes, "missing_ranks": sorted(c.missing_ranks or []),
                "mismatch": str(c.type_of_mismatch) if c.type_of_mismatch else None,
                "expected_ranks": sorted(c.expected_ranks or []),
                "frames": [{"file": f["filename"], "line": f["line"], "func": f["name"]}
                           for f in (c.collective_frames or [])],
            }
    return None
