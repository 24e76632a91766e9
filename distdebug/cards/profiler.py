"""profiler: torch.profiler traces of chosen steps and of the steps after a detector fires."""

from __future__ import annotations

from distdebug.cards.base import NOTE, Card, Option, Variant
from distdebug.config import ProfilerConfig

CARD = Card(
    code="DD404", name="profiler", family="performance", source="detector (in its windows only)",
    title="torch.profiler traces of --profile-steps windows and of the steps after a detector fires",
    severities=("info",),
    meaning="A note that a profiler window was traced (or could not be): the report's performance section reads "
            "the traces for each rank's data share, communication share and top operators.",
    subjects="the window (`steps A-B`)",
    causes=("a window asked for with --profile-steps", "a detector fired (--profile-on-finding)"),
    check="`distdebug report RUN`: the performance section; the traces in the run directory open in Perfetto",
    fix="nothing: a trace, not a fault",
    kind="other", noun="the profiler window",
    options=(Option("steps", ProfilerConfig.steps, "A:B[,C:D]: trace these optimizer steps on every rank",
                    "--profile-steps"),
             Option("on_finding", ProfilerConfig.on_finding, "steps traced after a detector fires (once a run); "
                    "0: off", "--profile-on-finding")),
    cost="outside its windows, one set lookup a step; inside, torch.profiler's own cost",
    variants=(Variant("any", NOTE, "a traced window (not a fault)", "the report's performance section",
                      "nothing", own_fix=True),),
)
