"""log_volume: output that fills a disk before the job ends."""

from __future__ import annotations

from distdebug.cards.base import DISK, Card, Variant

CARD = Card(
    code="DD602", name="log_volume", family="run", source="the launcher's volume guard (measured a minute after "
    "the start, then every ten)",
    title="the job's output (prints, NCCL_DEBUG, torchrun's logs, the run directory) fills its file system before "
          "the job is expected to end",
    severities=("info", "warning"),
    meaning="At the rate this node wrote, a file system fills before the job is expected to end: the script's "
            "prints, NCCL_DEBUG's per-collective lines, torchrun's log folder or a run-directory budget larger "
            "than its disk. Said with the bytes an hour per destination.",
    subjects="the mount point, or the variable that writes (`NCCL_DEBUG`)",
    causes=("prints every step on every rank", "NCCL_DEBUG=INFO with per-collective lines",
            "a run-directory budget larger than the disk"),
    check="the finding's bytes an hour per destination; df -h on the file system it names; the report's disk: line",
    fix="write less, or somewhere with room",
    kind="other", noun="the output volume",
    cost="a directory scan a minute after the start and every ten minutes, off the training's threads",
    variants=(
        Variant("any", DISK, "output nobody sized: the script's prints into the job's output file, NCCL_DEBUG's "
                "per-collective lines, torchrun's log folder, or a run-directory budget larger than its disk",
                "the finding's bytes an hour per destination; df -h on the file system it names; the report's "
                "disk: line (the prediction beside what was then written)",
                "write less, or somewhere with room", own_fix=True),
    ),
)
