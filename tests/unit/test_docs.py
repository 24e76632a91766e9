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


def test_the_built_pages_check_finds_a_dashed_option_and_a_curly_quote_in_a_command(tmp_path):
    """docs/check_built.py (run by .ci/run on the built site, smart quotes off in conf.py) can fail: the two ways
    Sphinx's smart quotes broke a pasted command, and a page that pastes as written."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import check_built
    finally:
        sys.path.remove(str(ROOT / "docs"))
    broken = ("<html><body><p>replay with <span>\u2013fault</span> nan_grad and \u2014keep-runs</p>"
              "<pre>distdebug attach --inject \u201cnan_grad:rank=1\u201d train.py</pre></body></html>")
    found = check_built.problems(broken)
    assert len(found) == 4 and "'\u2013fault'" in found[0] and "'\u2014keep-runs'" in found[1]
    assert all("curly quote" in f for f in found[2:])
    fine = ("<html><body><p>a range 1\u20132, an aside \u2014 then <code>--fault nan_grad</code> or --keep-runs; "
            "\u201cquoted\u201d prose</p><pre>distdebug attach --inject 'nan_grad:rank=1' train.py</pre></body></html>")
    assert check_built.problems(fine) == []
    site = tmp_path / "html"
    site.mkdir()
    (site / "a.html").write_text(fine)
    assert check_built.main([str(site)]) == 0
    (site / "b.html").write_text(broken)
    assert check_built.main([str(site)]) == 1


def test_every_recipe_command_in_the_guides_names_a_recipe_and_options_it_takes():
    """A command a guide gives on a recipe pastes as written (the parity guide's, above all): the recipe is there
    and takes every option the command passes it (read from its argparse calls, no launch: the launch of the
    same pair is tests/e2e/test_parity_recipes.py's)."""
    commands = 0
    for page in sorted((ROOT / "docs" / "guides").glob("*.md")):
        for m in re.finditer(r"recipes/(\w+\.py)((?: +--?[\w-]+(?: +[\w.:-]+)?)*)", page.read_text()):
            recipe = ROOT / "recipes" / m.group(1)
            assert recipe.is_file(), (page.name, m.group(0))
            source = recipe.read_text() + (ROOT / "recipes" / "_common.py").read_text()
            for option in re.findall(r"(?<![\w-])(--[\w-]+)", m.group(2)):
                assert f'"{option}"' in source, (page.name, m.group(0), option)
            commands += 1
    assert commands >= 3
