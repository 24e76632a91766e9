"""Tier 1: the README's run-directory section lists exactly the files of layout.FILES and every
record kind of the schema (issue 19): a new file or kind is documented, or this fails."""

from __future__ import annotations

import re
from pathlib import Path

from distdebug.artifacts import layout, schema

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = {"node": 0, "rank": 0, "start": 4, "end": 6}


def section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## The run directory\n")
    return text[start:text.index("\n## ", start + 1)]


def documented_paths(sec: str) -> set[str]:
    """First word of each entry in the indented listing below the run directory's own line."""
    lines = sec.split("\n")
    top = next(i for i, line in enumerate(lines) if line.startswith("    distdebug-runs/"))
    out = set()
    for line in lines[top + 1:]:
        if not line.startswith("      "):
            break
        word = line.split()[0]
        if not line.startswith("       ") and ("." in word or "/" in word):
            out.add(word)
    return out


def matches_layout(relative: str) -> bool:
    """Whether a path relative to a run directory is one of layout.FILES' templates."""
    for template, _ in layout.FILES:
        pattern = re.escape(template)
        for field in ("node", "rank", "start", "end"):
            pattern = re.sub(r"\\\{" + field + r"(:0\d+d)?\\\}", r"\\d+", pattern)
        if re.fullmatch(pattern, relative):
            return True
    return False


def test_every_file_of_the_layout_is_in_the_readme_and_nothing_else():
    expected = {template.format(**EXAMPLE) for template, _ in layout.FILES}
    assert len(expected) == len(layout.FILES) >= 13
    assert documented_paths(section()) == expected


def test_every_record_kind_is_in_the_readme():
    sec = section()
    para = sec[sec.index("Record kinds"):]
    para = para[:para.index("\n\n")]
    named = set(re.findall(r"`([a-z_]+)`", para))
    assert named == set(schema.KINDS)


def test_layout_matcher_tells_layout_files_from_others():
    assert matches_layout("rank-00003/events.jsonl") and matches_layout("nodes/node-001.json")
    assert matches_layout("traces/steps-12-15/rank-00001.pt.trace.json.gz")
    assert not matches_layout("rank-00003/notes.txt") and not matches_layout("report.html")
