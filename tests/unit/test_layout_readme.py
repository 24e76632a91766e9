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


def house_layout() -> str:
    """The README's picture of the folders and their roles (its "Layout and tests" listing)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Layout and tests\n")
    return text[start:text.index("\nLint and types", start)]


def test_the_house_layout_names_every_folder_and_module_and_nothing_that_is_not_there():
    """Issue 47: the README's layout omitted five modules. Every folder of distdebug/ and every module in
    it and in fault_injection/ is named where a contributor reads the house's layout (each detector and
    each fault is one module of its registry: `distdebug detectors` and `distdebug faults list` list them),
    and every folder the listing names exists."""
    from distdebug.detectors.registry import builtin
    from distdebug.fault_injection.registry import FAULTS

    listing = house_layout()
    plugins = {cls.__module__.rpartition(".")[2] for cls in builtin().values()} | set(FAULTS)
    missing = []
    for folder in sorted(p for p in (ROOT / "distdebug").iterdir() if p.is_dir() and p.name[0] not in "_."):
        if not re.search(rf"^\s+{folder.name}/", listing, re.M):
            missing.append(f"{folder.name}/")
        for module in folder.rglob("*.py"):  # a detector grown into a package: its modules are its own
            if module.parent != folder and module.parent.name in plugins:
                continue
            if module.stem != "__init__" and module.stem not in plugins and \
                    not re.search(rf"\b{module.stem}\b", listing):
                missing.append(f"{folder.name}/{module.name}")
    for module in [*(ROOT / "distdebug").glob("*.py"), *(ROOT / "fault_injection").glob("*.py")]:
        if module.stem not in ("__init__", "__main__", *plugins) and not re.search(rf"\b{module.stem}\b", listing):
            missing.append(str(module.relative_to(ROOT)))
    assert missing == []
    named = set(re.findall(r"^ {6}(\w+)/", listing, re.M))
    assert named and {n for n in named if not (ROOT / "distdebug" / n).is_dir()} == set()
