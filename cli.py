"""The project's root entry (``python cli.py ...`` from a checkout, as the layout keeps it).

The click application lives in the package (``distdebug/cli/``), so that the installed console
script points into ``distdebug`` and nothing named ``cli`` lands at the top of site-packages.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # this checkout's package, not another install
    from distdebug.cli import main

    main()
