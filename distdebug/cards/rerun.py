"""rerun: a flagged step re-executed from a capture, to tell a code or data fault from a machine's."""

from __future__ import annotations

from distdebug.cards.base import LOSSES_DIFFER, NOTE, Card, Option, Variant
from distdebug.config import RerunConfig

CARD = Card(
    code="DD206", name="rerun", family="replicas", source="detector (opt-in: --rerun-on-anomaly)",
    title="re-executes a flagged step from a capture: reproducible (code or data) or transient (the machine)",
    severities=("info", "warning", "error"),
    meaning="A step another detector flagged (a NaN, a replica that parted) was re-executed on its rank from a "
            "capture of its inputs and parameters. Reproducible: the code or the data did it. Not reproducible: a "
            "transient fault of the machine (silent data corruption). The parameters reading differently again: "
            "stored corruption or a read error. Not re-executed (an info note says why): a model's first step, "
            "before it is discovered; a forward with gradients off; a compiled module; a DeepSpeed engine's "
            "backward; a sharded model (FSDP2, DTensor), whose forward gathers from its peers.",
    subjects="`re-execution of step N`",
    causes=("the step's code or batch (reproducible)", "the machine: a transient compute fault (not reproducible)",
            "memory that corrupts what it stores (stored corruption)"),
    check="the verdict in the evidence; for the machine, its ECC counters (nvidia-smi -q -d ECC)",
    fix="reproducible: debug that step's batch and code path; not reproducible: drain the machine and resume "
        "elsewhere from the last checkpoint",
    kind="verdict", noun="the re-execution's verdict", default=False,
    faults=("transient_compute", "persistent_compute", "bitflip_param"),
    options=(Option("max_reruns", RerunConfig.max_reruns, "steps re-executed per rank and run at most",
                    "--rerun-on-anomaly"),
             Option("keep", RerunConfig.keep, "captures of the last steps held (each a copy of the parameters, "
                    "buffers and the step's inputs)")),
    cost="a copy of the parameters, buffers and inputs for each of the last `keep` steps; two steps' compute for "
         "each re-execution",
    variants=(
        Variant("the step was not re-executed (info)", NOTE,
                "the flagged step could not be re-executed (too late, or not captured): no verdict",
                "the finding's reason", "nothing; raise rerun.keep if the flag came too late",
                when=lambda f, c: f.severity == "info", own_fix=True, explains_root=True),
        Variant("a verdict on the step", LOSSES_DIFFER,
                "the re-execution says whether the code and data[[ ({ev[verdict]})]] or the machine did it",
                "the verdict in the finding's evidence; the machine's ECC counters (nvidia-smi -q -d ECC)",
                "reproducible: debug that step's batch and code path; not reproducible: drain the machine and "
                "resume elsewhere from the last checkpoint", own_fix=True, explains_root=True),
    ),
)
