"""The one error type users see.

Every verb catches `EdgeError` at the CLI boundary and prints its message as one line with exit code 2,
so a message must name the file or flag at fault and say what was expected.
"""

from __future__ import annotations


class EdgeError(Exception):
    """A user-facing failure: bad input, a corrupt file, an export that does not verify."""


def need(condition: bool, message: str) -> None:
    """Raise `EdgeError(message)` unless `condition` holds."""
    if not condition:
        raise EdgeError(message)
