"""Errors that reach the user as one line (no traceback) and a non-zero exit code."""

from __future__ import annotations


class UserError(Exception):
    """Bad input or environment: the message says what is wrong and what to do.

    ``exit_code`` follows the shell's convention: 2 for usage errors, 1 otherwise.
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
