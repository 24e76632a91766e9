"""Append-only JSON Lines writer for one rank's event stream.

Why ``os.write`` on an ``O_APPEND`` descriptor and no background thread: each record is one
small write into the page cache (microseconds, never a disk flush), and whatever was written
survives a SIGKILL of the rank, because the kernel already holds it. A queue drained by a thread
would lose its backlog exactly when a rank is killed, which is when the records matter most.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from distdebug.artifacts.redact import Redactor


class EventWriter:
    """Writes one record per line; thread-safe; never raises into training after open."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        self.failed_writes = 0
        self._redact = Redactor()  # secrets never land in the run directory (artifacts.redact)

    def write(self, record: dict) -> None:
        line = (self._redact(json.dumps(record, separators=(",", ":"), default=str)) + "\n").encode()
        with self._lock:
            if self._fd is None:
                return
            try:
                # One write() per record: with O_APPEND, concurrent records never interleave.
                os.write(self._fd, line)
            except OSError:
                # A full disk must not stop training; the count is reported at close.
                self.failed_writes += 1

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def append_run_findings(run_dir: Path, findings: list) -> None:
    """Append run-level findings (``Finding`` objects) to the run's findings.jsonl."""
    from distdebug.artifacts import layout, schema

    w = EventWriter(layout.run_findings_path(run_dir))
    for f in findings:
        w.write(schema.record(schema.FINDING, **f.to_dict()))
    w.close()


def write_json_atomic(path: Path, data: dict) -> None:
    """One JSON file (a manifest, a node's record, a stacks request or answer), secrets redacted, written
    aside and renamed: a reader never sees half of it, and a writer killed midway leaves the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(Redactor()(json.dumps(data, indent=2, default=str)))
    os.replace(tmp, path)
