"""An executor of one daemon thread, for background work a process's exit must not wait for."""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonExecutor:
    """Runs the calls submitted to it one at a time, in order, in one daemon thread.

    The threads of `concurrent.futures.ThreadPoolExecutor` are joined when the interpreter exits,
    so a process stopped by a signal (scheduler.cluster.stop_on_signals) would wait out the call
    under way: a cost model's retraining takes seconds. Here the process ends without it; work
    whose result is kept must therefore be atomic (a retraining saves its model in one
    transaction, and the trials it learns from are stored already).
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[cf.Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._work, daemon=True, name=name)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> cf.Future[T]:
        """`fn(*args)` once the calls before it have run; its future. Raises RuntimeError after
        `shutdown`."""
        if self._closed:
            raise RuntimeError("the executor is shut down")
        future: cf.Future[T] = cf.Future()
        self._calls.put((future, fn, args))
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Accept no more calls; with `cancel_futures` the ones not started are cancelled, and with
        `wait` this returns once the rest have run."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
                if call is not None:
                    call[0].cancel()
        self._calls.put(None)
        if wait:
            self._thread.join()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # the caller's to see, as with concurrent.futures
                future.set_exception(e)
            else:
                future.set_result(result)
