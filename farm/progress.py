"""The one progress display of a job, fed from its status documents (ResultStore.job).

`farm tune`, `Job.wait(progress=True)` and any other follower of a job show the same thing:
per task, trials done of its budget, how many ran correctly, the best latency so far and the
time elapsed; a model's job (`farm tune-model`) shows its model first, with the job's trials and
the model's estimated latency (farm.core.allocation.model_latency). On a terminal these are live
bars; when the output is not a terminal (piped to `tee`, a CI log) a plain line per task is printed
every `every` seconds and at the end, so a log shows progress as it happens and nothing is cut to a
terminal's width.

Until the job's first trial arrives, the display says what the job waits for: queued for a
scheduler, or starting (queued or claimed), with the latest start-up step the scheduler logged in this process
(logger "farm.scheduler", INFO: "Ray ready in 5.1 s", "2 llvm worker actor(s) up in ...", "task
N: ... shard searches ... ready ..."). A job run by a scheduler elsewhere logs nothing here: the
display then says only how long it has been starting.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from farm.core.workloads import workload_label

SCHEDULER_LOGGER = "farm.scheduler"
# A start-up step goes to the listeners with whether logging's own handlers show it too.
StepListener = Callable[[str, bool], None]


def make_console(stderr: bool = False) -> Console:
    """A console for the farm's output. Away from a terminal (a pipe, a file, a CI log) rich
    would wrap and cut at 80 columns; there nothing is wrapped or cut."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=100_000, soft_wrap=True)


def format_seconds(seconds: float) -> str:
    """A duration for people: `45 s`, `3 min 20 s`, `2 h 05 min`."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def format_latency(seconds: float | None) -> str:
    """A latency in µs for people; `-` for none (no correct trial yet)."""
    return "-" if seconds is None else f"{seconds * 1e6:.2f} µs"


class _SchedulerSteps(logging.Filter):
    """Hands the scheduler's log messages (INFO and above) to listeners, while any is registered.

    A filter on the "farm.scheduler" logger rather than a handler: while listeners are
    registered the logger is lowered to INFO, so that its INFO messages are produced at all
    (`farm tune` logs only warnings unless -v), and the filter lets through to logging's
    handlers only what the logger passed before, so no log line appears that was not asked for.
    Thread-safe: the scheduler logs from its own threads.
    """

    def __init__(self) -> None:
        super().__init__()
        self._listeners: list[StepListener] = []
        self._lock = threading.Lock()
        self._threshold = logging.WARNING  # the lowest level logging showed before install
        self._saved_level = logging.NOTSET

    def add(self, listener: StepListener) -> None:
        with self._lock:
            if not self._listeners:
                logger = logging.getLogger(SCHEDULER_LOGGER)
                self._threshold, self._saved_level = logger.getEffectiveLevel(), logger.level
                if self._threshold > logging.INFO:
                    logger.setLevel(logging.INFO)
                logger.addFilter(self)
            self._listeners.append(listener)

    def discard(self, listener: StepListener) -> None:
        """Unregister `listener` (nothing if it is not registered); the last one restores the logger."""
        with self._lock:
            if listener not in self._listeners:
                return
            self._listeners.remove(listener)
            if not self._listeners:
                logger = logging.getLogger(SCHEDULER_LOGGER)
                logger.removeFilter(self)
                logger.setLevel(self._saved_level)

    def filter(self, record: logging.LogRecord) -> bool:
        shown = record.levelno >= self._threshold
        if record.levelno >= logging.INFO:
            with self._lock:
                listeners = list(self._listeners)
            for listener in listeners:
                try:
                    listener(record.getMessage(), shown)
                except Exception:  # a display must never break the scheduler's logging
                    pass
        return shown


_STEPS = _SchedulerSteps()


class _Bars(Progress):
    """Progress bars with a status line above them while `status()` returns one."""

    def __init__(self, *columns: Any, status: Callable[[], str | None], **kwargs: Any) -> None:
        self._status = status  # first: Progress's constructor renders already
        super().__init__(*columns, **kwargs)

    def get_renderables(self) -> Iterable[RenderableType]:
        line = self._status()
        if line:
            yield Text(line, style="dim", no_wrap=True, overflow="ellipsis")
        yield from super().get_renderables()


# The bar of a model job's model, above its tasks' (task ids are positive).
MODEL_BAR = -1


def _model_line(job: dict[str, Any]) -> tuple[str, str] | None:
    """A model job's (description, estimated latency) for its model's line; None for other jobs."""
    model = (job.get("spec") or {}).get("model")
    if model is None:
        return None
    from farm.core.allocation import model_kernels, model_latency

    return f"model {model['name']}", format_latency(model_latency(model_kernels(job["tasks"])))


class JobProgress:
    """Shows the progress of one job; `update` with each new status document, `close` at the end.

    From its creation until a trial arrives after the first `update` (or `close`), it listens to
    the scheduler's start-up steps logged in this process (see the module docstring): on a
    terminal the latest is the status line above the bars; elsewhere each is printed as a plain
    line when it is logged, unless logging prints it already.
    """

    def __init__(self, console: Console | None = None, every: float = 10.0) -> None:
        self.console = console or make_console(stderr=True)
        self.live = self.console.is_terminal
        self.every = every
        self._last_line = 0.0
        self._last_doc: dict[str, Any] | None = None
        self._ids: dict[int, TaskID] = {}
        self._created = time.monotonic()
        self._trials_at_start: int | None = None
        self._starting = True
        self._step: str | None = None
        self._bars: Progress | None = None
        if self.live:
            self._bars = _Bars(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("ok {task.fields[ok]}"), TextColumn("best {task.fields[best]}"),
                               TimeElapsedColumn(), console=self.console, status=self.status_line)
            self._bars.start()
        _STEPS.add(self._on_step)

    def status_line(self) -> str | None:
        """What the job waits for, until its first trial arrives; None after."""
        if not self._starting:
            return None
        elapsed = format_seconds(time.monotonic() - self._created)
        # A queued job for which this process logs start-up steps is about to be claimed here:
        # `farm tune` starts its workers while the job is checked and stored (Client.prepare).
        if self._last_doc is not None and self._last_doc["status"] == "queued" and self._step is None:
            return f"queued, {elapsed}: waiting for a scheduler to claim it"
        return f"starting, {elapsed}: {self._step or 'waiting for the first trial'}"

    def _on_step(self, message: str, shown_by_logging: bool) -> None:
        if not self._starting:
            return
        self._step = message
        if self._bars is None and not shown_by_logging:
            job = f"job {self._last_doc['id']}: " if self._last_doc is not None else ""
            self.console.print(f"{job}{self.status_line()}", markup=False, highlight=False, soft_wrap=True)

    def update(self, job: dict[str, Any]) -> None:
        """Show `job` (a ResultStore.job document)."""
        self._last_doc = job
        if self._trials_at_start is None:
            self._trials_at_start = job["trials"]
        elif self._starting and job["trials"] > self._trials_at_start:
            self._end_start_up()
        if self._bars is not None:
            if (model := _model_line(job)) is not None:  # a model's job: the model first, its whole budget
                if MODEL_BAR not in self._ids:
                    self._ids[MODEL_BAR] = self._bars.add_task(model[0], total=job["trials_budget"], ok="", best="-")
                self._bars.update(self._ids[MODEL_BAR], completed=job["trials"], best=model[1])
            for task in job["tasks"]:
                if task["id"] not in self._ids:
                    self._ids[task["id"]] = self._bars.add_task(
                        workload_label(task["workload"], params=False), total=task["budget"], ok=0, best="-")
                # A model job's budget moves between its tasks: a task's total grows as it gets more.
                self._bars.update(self._ids[task["id"]], completed=task["trials"], total=task["budget"],
                                  ok=task["counts"].get("ok", 0), best=format_latency(task["best_latency"]))
        elif time.monotonic() - self._last_line >= self.every:
            self._print_lines(job)

    def _end_start_up(self) -> None:
        self._starting = False
        _STEPS.discard(self._on_step)

    def _print_lines(self, job: dict[str, Any]) -> None:
        self._last_line = time.monotonic()
        if (model := _model_line(job)) is not None:
            self.console.print(f"job {job['id']} {model[0]}: {job['trials']}/{job['trials_budget']} trials, "
                               f"estimated latency {model[1]}", markup=False, highlight=False, soft_wrap=True)
        for task in job["tasks"]:
            self.console.print(f"job {job['id']} task {task['id']} {workload_label(task['workload'], params=False)}: "
                               f"{task['trials']}/{task['budget']} trials, ok {task['counts'].get('ok', 0)}, "
                               f"best {format_latency(task['best_latency'])}", markup=False, highlight=False,
                               soft_wrap=True)

    def close(self) -> None:
        self._end_start_up()
        if self._bars is not None:
            self._bars.stop()
        elif self._last_doc is not None:
            self._print_lines(self._last_doc)
