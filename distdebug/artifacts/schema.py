"""Versioned record kinds of the per-rank event stream and of the manifest.

Every record carries ``v`` (schema version) and ``kind``. Readers accept any version up to
SCHEMA_VERSION and ignore unknown keys, so new fields never break old reports.
"""

from __future__ import annotations

SCHEMA_VERSION = 1
MANIFEST_SCHEMA = "distdebug.manifest"

# Event kinds in rank-NNNNN/events.jsonl, in the order a healthy rank writes them.
START = "start"            # identity: rank, local_rank, node, world_size, host, pid, attempt
DISCOVERY = "discovery"    # models (and wrappers), optimizers, process group, step source
STEP = "step"              # step, loss, step_time_s, backward_calls, collectives
FINDING = "finding"        # a detector's (or the harness's) finding; see distdebug.findings.Finding
SCRIPT_ERROR = "script_error"  # the training script raised: exception type and message
END = "end"                # exit_code, steps; absent when the rank was killed
PG_INIT = "pg_init"        # init_process_group entered (phase "begin") or returned ("done")
STALL = "stall"            # no progress for stall_timeout: phase, last step, collective in flight, stacks
STALL_CLEARED = "stall_cleared"  # progress resumed after a stall record
INJECTED = "injected"      # a fault acted (distdebug attach --inject): fault, step, what it did
NOT_ACTED = "not_acted"    # a fault did not act, or what it did was undone: fault, step, reason (its own words)
PROBE = "probe"            # faults replay's clean run: a fact about the script (a DataLoader, a load, ...)
STRAGGLER_SCORES = "straggler_scores"  # rank 0: per-rank relative speed score, work, data wait, lateness
MEMORY = "memory"          # bytes: parameters, gradients, optimizer_state, activations, other (GPU), total
MEMORY_PEAK = "memory_peak"  # the step and breakdown with the largest total
TRACE = "trace"            # a profiler window written: steps [A, B], path of this rank's gzip Chrome trace
HARNESS_COST = "harness_cost"  # cumulative: steps, training-thread ms per detector, threads' CPU ms, host reads
OVERHEAD_BLOCK = "overhead_block"  # attach --measure-overhead: a pair (block), on_first, on_s/off_s, on/off_cpu_s
WRITE_FAILED = "write_failed"  # the rank's writes failed (a full disk, EIO, read-only): error, the record lost
PARITY = "parity"          # attach --parity, at its chosen steps: each parameter's and gradient's sketch and norm
PARITY_STEP = "parity_step"  # attach --parity, rank 0, every step: the gradients' global norm
STEPS_THINNED = "steps_thinned"  # a window of steps past the run-directory budget's ring: first, last, steps,
#                                  loss/step_time_s/backward_calls/collectives as [min, median, max] (retention)
KINDS = (START, DISCOVERY, STEP, FINDING, SCRIPT_ERROR, END, PG_INIT, STALL, STALL_CLEARED, INJECTED, NOT_ACTED,
         STRAGGLER_SCORES, MEMORY, MEMORY_PEAK, TRACE, HARNESS_COST, OVERHEAD_BLOCK, PROBE, WRITE_FAILED,
         STEPS_THINNED, PARITY, PARITY_STEP)
BULK = frozenset({STEP, MEMORY, HARNESS_COST, STRAGGLER_SCORES, PARITY_STEP})
"""The per-step kinds, the bulk of a stream: thinned past the budget's ring (artifacts.retention), digested for
the readers at scale (artifacts.digest); every other kind is rare and kept as written."""
ESSENTIAL = frozenset({START, FINDING, SCRIPT_ERROR, END, STALL, STALL_CLEARED, INJECTED, NOT_ACTED, WRITE_FAILED})
"""What a rank keeps writing once its writes have failed (artifacts.writer): who it was, what was found, a stall
(the hang verdict reads it), how it ended; the per-step records, the bulk, are dropped."""


def record(kind: str, **fields: object) -> dict:
    """A new record of ``kind`` at the current schema version."""
    return {"v": SCHEMA_VERSION, "kind": kind, **fields}
