"""link_matrix: one slow link between two ranks."""

from __future__ import annotations

from distdebug.cards.base import ENVIRONMENT, Card, Variant

CARD = Card(
    code="DD503", name="link_matrix", family="environment", source="`distdebug doctor --bandwidth` (every pair "
    "of ranks measured)",
    title="a link between two ranks much slower than the others (cabling, PCIe path, NIC)",
    severities=("warning",),
    meaning="Doctor measured the bandwidth between every pair of ranks; this pair's link is far slower than the "
            "median link, so every collective that crosses it runs at its speed.",
    subjects="`link A-B`",
    causes=("a bad cable or port", "a PCIe path through the CPU socket instead of a switch", "a NIC at a lower "
            "speed or on the wrong NUMA node"),
    check="`distdebug doctor --nproc-per-node N --bandwidth`: the matrix",
    fix="fix the flagged link (cable, port, NIC); meanwhile keep those two ranks off each other's rings",
    kind="environment", noun="the slow link",
    faults=("slow_link",),
    cost="doctor only: not run during training",
    variants=(
        Variant("any", ENVIRONMENT,
                "the environment (the usual cause of distributed failures): one slow link between two ranks "
                "(cabling, PCIe path, NIC)", "distdebug doctor --nproc-per-node N --bandwidth",
                "fix the flagged link (cable, port, NIC); meanwhile keep those two ranks off each other's rings"),
    ),
)
