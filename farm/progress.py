"""The one progress display of a job, fed from its status documents (ResultStore.job).

`farm tune`, `Job.wait(progress=True)` and any other follower of a job show the same thing:
per task, trials done of its budget, how many ran correctly, the best latency so far and the
time elapsed. On a terminal these are live bars; when the output is not a terminal (piped to
`tee`, a CI log) a plain line per task is printed every `every` seconds and at the end, so a
log shows progress as it happens and nothing is cut to a terminal's width.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


def make_console(stderr: bool = False) -> Console:
    """A console for the farm's output. Away from a terminal (a pipe, a file, a CI log) rich
    would wrap and cut at 80 columns; there nothing is wrapped or cut."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=100_000, soft_wrap=True)


def _best(task: dict[str, Any]) -> str:
    return "-" if task["best_latency"] is None else f"{task['best_latency'] * 1e6:.1f} µs"


class JobProgress:
    """Shows the progress of one job; `update` with each new status document, `close` at the end."""

    def __init__(self, console: Console | None = None, every: float = 10.0) -> None:
        self.console = console or make_console(stderr=True)
        self.live = self.console.is_terminal
        self.every = every
        self._last_line = 0.0
        self._last_doc: dict[str, Any] | None = None
        self._ids: dict[int, TaskID] = {}
        self._bars: Progress | None = None
        if self.live:
            self._bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("ok {task.fields[ok]}"), TextColumn("best {task.fields[best]}"),
                                  TimeElapsedColumn(), console=self.console)
            self._bars.start()

    def update(self, job: dict[str, Any]) -> None:
        """Show `job` (a ResultStore.job document)."""
        self._last_doc = job
        if self._bars is not None:
            for task in job["tasks"]:
                if task["id"] not in self._ids:
                    self._ids[task["id"]] = self._bars.add_task(task["workload"]["name"], total=task["budget"],
                                                                ok=0, best="-")
                self._bars.update(self._ids[task["id"]], completed=task["trials"],
                                  ok=task["counts"].get("ok", 0), best=_best(task))
        elif time.monotonic() - self._last_line >= self.every:
            self._print_lines(job)

    def _print_lines(self, job: dict[str, Any]) -> None:
        self._last_line = time.monotonic()
        for task in job["tasks"]:
            self.console.print(f"job {job['id']} task {task['id']} {task['workload']['name']}: "
                               f"{task['trials']}/{task['budget']} trials, ok {task['counts'].get('ok', 0)}, "
                               f"best {_best(task)}", markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._bars is not None:
            self._bars.stop()
        elif self._last_doc is not None:
            self._print_lines(self._last_doc)
