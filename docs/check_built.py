"""What a reader pastes from the built site works: no option turned into a dash, no curly quote in a command.

Run on the built HTML (``.ci/run`` does, after ``sphinx-build``): ``python docs/check_built.py BUILD_DIR``. One
line per place found, exit 1 if any. Why: Sphinx's smart quotes once turned ``--fault`` written in prose into
"–fault" and quotes into curly ones on 18 pages; a command pasted from there fails in a shell (issue 63). conf.py
turns them off; this holds it, whatever a later page or setting does.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

DASHED_OPTION = re.compile(r"(?<![\w\-])[\u2012\u2013\u2014\u2015\u2212]{1,2}[a-z][a-z0-9-]*")
"""An en or em dash (or a minus sign) straight before a lowercase word: what smart quotes make of ``--option``."""
CURLY = re.compile("[\u2018\u2019\u201c\u201d]")
CODE = re.compile(r"<(code|pre)\b[^>]*>(.*?)</\1>", re.S)
TAGS = re.compile(r"<[^>]+>")


def problems(page: str) -> list[str]:
    """Each place on one HTML page where a pasted command would differ from what it shows."""
    out = []
    body = page.split("<body", 1)[-1]
    for m in DASHED_OPTION.finditer(html.unescape(TAGS.sub(" ", body))):
        out.append(f"an option with a dash: {m.group(0)!r}")
    for m in CODE.finditer(body):
        text = html.unescape(TAGS.sub("", m.group(2)))
        for q in CURLY.finditer(text):
            out.append(f"a curly quote in a command: {text[max(0, q.start() - 30):q.end() + 30]!r}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python docs/check_built.py BUILD_DIR (the folder sphinx-build wrote)", file=sys.stderr)
        return 2
    root = Path(argv[0])
    pages = sorted(root.rglob("*.html"))
    found = [f"{p.relative_to(root)}: {what}" for p in pages for what in problems(p.read_text(encoding="utf-8"))]
    print("\n".join(found) if found else f"docs/check_built.py: {len(pages)} pages, every command pastes as written")
    return 1 if found or not pages else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
