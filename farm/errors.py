"""Errors a user can cause and fix. The CLI prints them as one line and exits with status 2."""

from __future__ import annotations


class FarmError(Exception):
    """A user error: bad workload, parameter, target, URL or file.

    The message is complete and says what to do; no traceback is shown for it.
    """
