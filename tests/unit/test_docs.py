"""Tier 1: the docs (issue 49). The pages built from the code are up to date (``docs/gen.py --check``: a card,
fault, option, exit code or JSON key changed in the code and not in the docs fails here, before CI's Sphinx
build); the README is a five-minute read whose links all lead somewhere, and its example is the examples' real
output. The Sphinx build itself (warnings as errors) runs in .ci/run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_generated_pages_are_up_to_date():
    r = subprocess.run([sys.executable, "docs/gen.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_check_fails_on_a_stale_page(tmp_path):
    """The check can fail: in a copy of the docs, a generated page edited by hand and one the code no longer
    makes are named."""
    copy = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", copy, ignore=shutil.ignore_patterns("_build"))
    page = copy / "reference" / "findings" / "oom.md"
    page.write_text(page.read_text() + "edited by hand\n")
    (copy / "reference" / "faults" / "gone.md").write_text("old\n")
    r = subprocess.run([sys.executable, "docs/gen.py", "--check", "--docs", str(copy)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "reference/findings/oom.md" in r.stderr and "faults/gone.md" in r.stderr
    # and writing them puts them right
    subprocess.run([sys.executable, "docs/gen.py", "--docs", str(copy)], cwd=ROOT, check=True, timeout=120)
    assert page.read_text() == (ROOT / "docs" / "reference" / "findings" / "oom.md").read_text()
    assert not (copy / "reference" / "faults" / "gone.md").exists()


def test_the_readme_is_short_and_every_link_leads_somewhere():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert len(links) > 20
    assert [link for link in links if not link.startswith("http") and not (ROOT / link).exists()] == []
    # what a newcomer looks for first
    for heading in ("## Status", "## Install", "## Quick start", "## Commands", "## In CI"):
        assert heading in text
    assert "GPU" in text[text.index("## Status"):text.index("## Install")]


def test_every_docs_page_is_reachable_from_the_index():
    """Sphinx says so too (-W); this is the quick check: every page is named in a toctree of its folder's index
    or the root index."""
    docs = ROOT / "docs"
    named: set[str] = set()
    for index in docs.rglob("*.md"):
        for block in re.findall(r"```\{toctree\}(.*?)```", index.read_text(), re.S):
            for line in block.splitlines():
                if line.strip() and not line.strip().startswith(":"):
                    named.add(str((index.parent / line.strip()).relative_to(docs)))
    pages = {str(p.relative_to(docs).with_suffix("")) for p in docs.rglob("*.md") if "_build" not in p.parts}
    assert pages - named - {"index"} == set()
