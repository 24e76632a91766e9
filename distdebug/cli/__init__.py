"""The ``distdebug`` command: a thin click layer over the library, a module per family of commands.

Imports here stay light (no torch): ``distdebug --help`` must answer in well under half a second. Every error
reaches the user as one line and a non-zero exit; set DISTDEBUG_DEBUG=1 to see distdebug's own traceback for an
internal error (``base.OneLineErrors``). A command's module registers it on ``base.main`` when imported below.
"""

from __future__ import annotations

from distdebug.cli import cmd_attach, cmd_faults, cmd_info, cmd_parity, cmd_read  # noqa: F401  (they register)
from distdebug.cli.base import main
from distdebug.cli.cmd_attach import attach

__all__ = ["attach", "main"]
