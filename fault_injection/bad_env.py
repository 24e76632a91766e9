"""bad_env: a dangerous communication variable set in every rank before the process group starts
(by default GLOO_SOCKET_IFNAME naming an interface this host does not have).

What must catch it is the environment check (``distdebug doctor``'s checks, which attach makes too: once
per node in its launcher, and again in a node's local rank 0, before the script's first line, for a variable
whose value changed since, as this fault's does).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from .base import Expect, Fault, Param

if TYPE_CHECKING:
    from .facts import Facts


class BadEnv(Fault):
    name = "bad_env"
    description = "a dangerous NCCL/GLOO variable (default GLOO_SOCKET_IFNAME=an interface that does not exist)"
    var: str
    value: str
    params = (Param("var", str, "GLOO_SOCKET_IFNAME", "variable name"),
              Param("value", str, "distdebug_missing0", "its value"))
    catcher = "env_check"
    engines = ("ddp",)
    exit_codes = (0, 1)  # a missing interface ends the job at init_process_group

    def setup(self, ctx: RankContext) -> None:
        super().setup(ctx)
        os.environ[self.var] = self.value
        self.injected(var=self.var, value=self.value)

    needs = 0

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if facts.backend not in ("gloo", "nccl"):
            return f"the backend is {facts.backend or 'unknown'}: no socket variable of gloo or NCCL to spoil"
        return super().applicable(facts)

    @classmethod
    def fit(cls, facts: Facts) -> dict[str, Any]:
        return {"var": "NCCL_SOCKET_IFNAME"} if facts.backend == "nccl" else {}

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("env_check", subject=next((i["var"] for i in injected), self.var))]
