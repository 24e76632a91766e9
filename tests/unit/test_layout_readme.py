"""Tier 1: the docs' run-directory page lists exactly the files of layout.FILES and every record kind of
the schema (issue 19): a new file or kind is documented, or this fails; and the architecture page names every
folder and module of the house."""

from __future__ import annotations

import re
from pathlib import Path

from distdebug.artifacts import layout, schema

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = {"node": 0, "rank": 0, "start": 4, "end": 6, "n": 1}


def section() -> str:
    return (ROOT / "docs" / "reference" / "run-directory.md").read_text()


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
        for field in ("node", "rank", "start", "end", "n"):
            pattern = re.sub(r"\\\{" + field + r"(:0\d+d)?\\\}", r"\\d+", pattern)
        if re.fullmatch(pattern, relative):
            return True
    return False


def test_every_file_of_the_layout_is_in_the_docs_and_nothing_else():
    expected = {template.format(**EXAMPLE) for template, _ in layout.FILES}
    assert len(expected) == len(layout.FILES) >= 13
    assert documented_paths(section()) == expected


def test_every_record_kind_is_in_the_docs():
    sec = section()
    para = sec[sec.index("Record kinds"):]
    para = para[:para.index("\n\n")]
    named = set(re.findall(r"`([a-z_]+)`", para))
    assert named == set(schema.KINDS)


def test_layout_matcher_tells_layout_files_from_others():
    assert matches_layout("rank-00003/events.jsonl") and matches_layout("nodes/node-001.json")
    assert matches_layout("traces/steps-12-15/rank-00001.pt.trace.json.gz")
    assert matches_layout("rank-00003/events.000012.jsonl") and matches_layout("rank-00003/events.thinned.jsonl")
    assert not matches_layout("rank-00003/notes.txt") and not matches_layout("report.html")


def house_layout() -> str:
    """The architecture page's picture of the folders and their roles (its "Layout and tests" listing)."""
    text = (ROOT / "docs" / "project" / "architecture.md").read_text()
    start = text.index("## Layout and tests\n")
    return text[start:text.index("\nLint and types", start)]


def test_the_house_layout_names_every_folder_and_module_and_nothing_that_is_not_there():
    """Issue 47: the README's layout omitted five modules. Every folder of distdebug/ and every module in
    it and in fault_injection/ is named where a contributor reads the house's layout, but for each
    detector's, card's and fault's own module (one module of its registry each: `distdebug detectors`,
    `distdebug explain` and `distdebug faults list` list them); a detector grown into a package names its
    modules in its own docstring (its map); and every folder the listing names exists."""
    import ast
    import sys

    from distdebug.cards import CARDS
    from distdebug.detectors.registry import builtin
    from distdebug.fault_injection.registry import FAULTS

    listing = house_layout()
    own = {Path(sys.modules[cls.__module__].__file__).resolve()  # type: ignore[arg-type]
           for cls in [*builtin().values(), *FAULTS.values()]}
    own |= {(ROOT / "distdebug" / "cards" / f"{name}.py").resolve() for name in CARDS}  # a card a module
    packages = {p.parent for p in own if p.name == "__init__.py"}
    missing = []

    def named(module: Path, text: str) -> bool:
        return bool(re.search(rf"\b{module.stem}\b", text))

    for folder in sorted(p for p in (ROOT / "distdebug").iterdir() if p.is_dir() and p.name[0] not in "_."):
        if not re.search(rf"^\s+{folder.name}/", listing, re.M):
            missing.append(f"{folder.name}/")
        for module in sorted(folder.rglob("*.py")):
            module = module.resolve()
            if module in own or module.stem == "__init__" and module.parent != folder:
                continue
            if module.parent in packages:  # a detector's package: its map is its __init__'s docstring
                doc = ast.get_docstring(ast.parse((module.parent / "__init__.py").read_text())) or ""
                if not named(module, doc):
                    missing.append(f"{module.relative_to(ROOT)} (in its package's docstring)")
            elif module.stem != "__init__" and not named(module, listing):
                missing.append(str(module.relative_to(ROOT)))
    for module in [*(ROOT / "distdebug").glob("*.py"), *(ROOT / "fault_injection").glob("*.py")]:
        if module.resolve() not in own and module.stem not in ("__init__", "__main__") \
                and not named(module, listing):
            missing.append(str(module.relative_to(ROOT)))
    assert missing == []
    folders = set(re.findall(r"^ {6}(\w+)/", listing, re.M))
    assert folders and {n for n in folders if not (ROOT / "distdebug" / n).is_dir()} == set()
