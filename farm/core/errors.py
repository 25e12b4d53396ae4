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


def brief(value: object, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters, for messages about input of any size: an error
    line must stay one short line even when the input was a megabyte of JSON."""
    try:
        text = repr(value)
    except RecursionError:  # a deeply nested container
        text = f"<deeply nested {type(value).__name__}>"
    text = text.replace("\0", "\\x00")
    return text if len(text) <= limit else text[: limit - 3] + "..."
