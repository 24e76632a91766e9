"""persistent_compute: transient_compute's twin: the module's output on that rank is wrong on every
execution from its step on (a unit that is broken, or a code path that always does it), so the
re-execution gives the same wrong value and ``rerun`` says: reproducible, debug the code path or the
data; it is not a passing fault of the machine."""

from __future__ import annotations

from .transient_compute import TransientCompute


class PersistentCompute(TransientCompute):
    name = "persistent_compute"
    description = "one module's output on one rank is wrong on every execution from one step on"
    persistent = True
    verdict = "reproducible"
