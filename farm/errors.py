"""Errors a user can cause and fix. The CLI prints them as one line and exits with status 2."""

from __future__ import annotations


class FarmError(Exception):
    """A user error: bad workload, parameter, target, URL or file.

    The message is complete and says what to do; no traceback is shown for it.
    """


def one_line(e: BaseException) -> str:
    """`Type: message` on one line. TVM errors carry a long C++ backtrace before the line
    that says what went wrong, so the last non-empty line is kept."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:500]
