"""straggler: a rank the others keep waiting for, and whether its compute or its data loader is slow."""

from __future__ import annotations

from distdebug.cards.base import SLOW, Card, Variant

_CHECK = ("distdebug attach --profile-steps A:B ... then distdebug report {run_dir}: the window's data share and top "
          "operators on that rank")
_CAUSE = "{ranks} is slow and every other rank waits for it at each collective: "

CARD = Card(
    code="DD401", name="straggler", family="performance", source="detector (arrival times at each step's "
    "collectives)",
    title="a rank the others keep waiting for (relative speed score from arrival times), and whether it computes "
          "slower or waits for its data loader",
    severities=("warning",),
    meaning="One rank arrives last at the step's collectives step after step, so every other rank waits for it: "
            "the job runs at the speed of its slowest rank. The evidence says whether its data loading or its "
            "compute is slow.",
    subjects="`compute` or `data loader`",
    causes=("a slow data loader on that rank (too few workers, a slow disk)", "a slower or throttled GPU",
            "a busy CPU", "uneven work (longer sequences on that rank)"),
    check="`distdebug attach --profile-steps A:B` then `distdebug report`: the window's data share and top operators "
          "on that rank",
    fix="data: prefetch and more DataLoader workers, pin_memory; compute: check that GPU's clocks and temperature, "
        "balance the work",
    kind="other", noun="the straggler",
    faults=("straggler", "slow_dataloader"),
    cost="two timestamps a step on every rank, in the exchange the harness already makes",
    variants=(
        Variant("its data loading is slow (evidence cause: data loader)", SLOW, _CAUSE + "its data loading", _CHECK,
                "prefetch and more DataLoader workers, pin_memory",
                when=lambda f, c: (f.evidence or {}).get("cause") == "data loader"),
        Variant("its compute is slow", SLOW,
                _CAUSE + "its compute (a slower or throttled GPU, a busy CPU, uneven work)", _CHECK,
                "check that GPU's clocks and temperature (nvidia-smi -q -d PERFORMANCE); balance the work"),
    ),
)
