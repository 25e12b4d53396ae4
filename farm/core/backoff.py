"""How the farm waits between tries of something that is down: `Backoff`.

A database, an RPC tracker or a server that is restarting is tried again soon (a short outage
is noticed within a fraction of a second), then less and less often (a long one costs few
tries and little log), never less often than every `maximum` seconds (its return is noticed
within that).
"""

from __future__ import annotations


class Backoff:
    """Delays that start at `first` seconds and double up to `maximum`.

    Not thread-safe: each waiting loop has its own. `reset()` after a success.
    """

    def __init__(self, first: float, maximum: float) -> None:
        if not 0 < first <= maximum:
            raise ValueError(f"Backoff needs 0 < first <= maximum, got first={first}, maximum={maximum}")
        self.first, self.maximum = first, maximum
        self._next = first

    def next(self) -> float:
        """The delay to wait now; the one after it is twice as long (at most `maximum`)."""
        delay = self._next
        self._next = min(self._next * 2, self.maximum)
        return delay

    def reset(self) -> None:
        """Start again from `first`."""
        self._next = self.first
