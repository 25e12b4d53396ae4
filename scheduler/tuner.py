"""The tuning loop of one job: shard each task's space over the workers and keep every device fed.

Work flows as a stream of small chunks rather than batches that wait for one another:

- Each worker keeps candidates in flight (being proposed, compiling, built and waiting, or
  measuring): as many as its builds need to keep its device busy, from its recent build and
  device seconds, at most `QUEUE_DEPTH * batch_size` (`scheduler.pool.Lead`): more would wait
  for the device and only age the model that proposed them. Its shard's search proposes them
  CHUNK at a time, in the search's own process, while the loop goes on; a chunk goes to its
  worker as soon as it is proposed, and comes back as soon as its few candidates are measured.
  So one slow compile holds back only its own chunk, and the device always has built candidates
  queued.
- A round closes every `pool.size * batch_size` results: the writer is flushed, and the shared
  cost model is retrained on every trial of the task's family in a background thread; the new
  model reaches every shard's search before its next proposal. Chunks go on flowing meanwhile,
  guided by the previous model until the new one arrives. A search with `refresh` N (XGBSearch)
  also gets a model retrained between round closes, in the same thread while it has nothing
  else to do, whenever N results have come in since the last training began: kept in memory,
  not saved, and not a round (scheduler.retrain.refreshed).
- A worker that joins mid-task (a GPU node joined the cluster: WorkerPool.grow, asked once a
  second) gets work at once, searching the shard of an earlier worker (worker i, shard i mod
  the shards): a shard's search never proposes a config twice, whoever asks.
- A chunk whose worker failed as a whole (its process died; the pool replaces it) is not a
  result: its configs are measured again on whichever worker has room, and recorded as failed
  only after MAX_ATTEMPTS such failures. A worker whose replacement waits for a device (its node
  left the cluster) takes no work meanwhile (WorkerPool.ready); with none left the job waits,
  and fails after `stall_seconds`. A worker that fails with a FarmError cannot measure at
  all (its device never registered): the job fails with that error.

A model-guided search (farm.core.search, `guided`) proposes at random until the task has a
model. Where its family has none yet, the loop hands out one round of such configs, then waits
for that round's retraining (and one more round if the retraining had too little to learn from),
so that the configs after the first round are the model's. While it waits, each worker gets a
bridge of BRIDGE_CHUNKS chunks of unguided configs more, as its last ones drain: its device
measures them instead of idling through the start of the retraining, and the first guided trial
comes at most that many configs later per worker. Without any bound the devices' queues were
refilled with random configs for as long as the first model trained (on fast kernels, a small
budget's every trial), and a run's first guided trial came late; with none at all the devices idled
through the retraining, the first proposals and their builds (docs/defaults.md#first-model-wait).
XGBoost is imported, and the task's features prepared, ahead of that first retraining
(farm.core.costmodel.warm_up).

The loop stops at each task's budget exactly, when the space is exhausted, or when the job is
cancelled or must stop (its scheduler interrupted): then nothing more is handed out, and the pool
stops the chunks in flight (`WorkerPool.cancel`): the candidates being measured finish and are
kept, those not yet measured are dropped, so the devices are free within a candidate. A job's budget is spread over its
tasks when the job is created (farm.core.jobspec.JobRequest).

The end game: once a task's whole budget is handed out, a worker with nothing left in flight
would wait for the others' last chunks, the task held by the slowest of their builds, its device
idle; so would a worker whose own last candidates are slow builds, its other build slots free,
and one whose open slices (a model job's, two at a time) all wait on such last candidates
(docs/defaults.md#end-game-grace).
Once such a worker has returned nothing for END_GAME_GRACE seconds, it gets new configs instead,
as many as the budget still lacks (at most what it may have in flight), and again after each
further grace. The first results to arrive
complete the budget; the task then ends without waiting for the chunks still out, whose results
are not recorded (the store holds the budget exactly, each config once). Only a worker that has
returned results in the task stands in, and only for workers that have too: one still starting
up (its first builds, its first session) is waited for, as without the end game. So a task
measures a few candidates more than its budget only where a device would otherwise have waited.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from db.store import ResultStore
from db.writer import ResultWriter
from farm.core import metrics
from farm.core.allocation import GradientAllocation, TaskState, model_kernels, model_latency
from farm.core.costmodel import StoredModel, warm_up
from farm.core.errors import FarmError, one_line
from farm.core.measure import MeasureResult, Status
from farm.core.search import parse_search
from farm.core.task import Task
from farm.core.workloads import workload_label
from scheduler.daemon_executor import DaemonExecutor
from scheduler.pool import QUEUE_DEPTH, Lead, WorkerPool
from scheduler.retrain import Retrained, refreshed, retrain, starting_model
from scheduler.shards import Proposal, ShardSearches

log = logging.getLogger("farm.scheduler")

# Candidates per call to a worker: results come back a few at a time (progress moves per few
# trials; a slow compile delays only its chunk's results), and a call costs about a millisecond
# (docs/defaults.md#chunk).
CHUNK = 4
# A config whose worker died under it this many times is recorded as failed (a candidate that
# kills its worker every time is data too).
MAX_ATTEMPTS = 3
# How often the loop asks whether the job was cancelled (the store) or must stop (`should_stop`).
CANCEL_POLL_SECONDS = 0.5
# How long a stopped task waits for its chunks in flight, which the pool has stopped: each comes
# back once the candidate it is measuring is measured (a hung one, after its time limit).
STOP_GRACE_SECONDS = 3.0
# Tasks of a job whose shard searches are kept between their slices (a model job's): each holds a
# search process per worker. A task whose searches were dropped starts them again from its trials in
# the store, latencies included (SearchStrategy.mark_measured), so they plan as the dropped ones would.
KEEP_SEARCHES = 4
# Trials of a model job's slice, at the least (its budget allowing): each slice starts with the
# devices waiting for its first builds and ends with a retraining, so slices much shorter than
# that spend a large part of their time on both (Ansor and MetaSchedule hand out 64 at a time too).
MIN_SLICE = 64
WARMUP_SHARE = 0.5  # of a model job's budget, at most, for its tasks' first slices (_allocate)
# A model job's slices open at once (_allocate): the one being measured to its end, and the next one,
# whose candidates the workers build meanwhile. Each holds its task's searches: fewer than KEEP_SEARCHES.
OPEN_SLICES = 2
# The job spec's allocation that moves a model job's budget between its tasks (farm.core.allocation).
GRADIENT = "gradient"
# How often a model job's estimated latency is read from the store for the metrics while a slice runs.
MODEL_REPORT_SECONDS = 1.0
# How long a model job with earlier records waits for its workers to name their devices (a device
# coming up: its server's registration and first session) before it learns them from its first trials.
DEVICE_NAME_SECONDS = 120.0
# The origin of a trial copied from an earlier job's (a task tuned before: `_reuse`).
REUSED = "reused"
# Chunks of unguided configs a worker gets while the job waits for a family's first model (the bridge,
# module docstring; docs/defaults.md#first-model-wait).
BRIDGE_CHUNKS = 1

# Seconds a worker idles at a task's end before it stands in for the others' last chunks (the end
# game, module docstring): the last chunks of workers going at the same pace come back within a
# second or two of each other, and those are waited for rather than measured twice
# (docs/defaults.md#end-game-grace).
END_GAME_GRACE = 3.0


@dataclass
class Progress:
    """What a progress display needs after each chunk of results."""

    task_number: int
    tasks: int
    task: Task
    done: int
    budget: int
    best_seconds: float | None
    last: list[MeasureResult]


def run_job(
    store: ResultStore,
    job_id: int,
    pool: WorkerPool,
    *,
    search: str = "xgb",
    seed: int = 0,
    batch_size: int = 16,
    on_progress: Callable[[Progress], None] | None = None,
    stall_seconds: float = 300.0,
    should_stop: Callable[[], bool] = lambda: False,
) -> str:
    """Run every task of the job to its budget on `pool`; returns the final status ("done" or
    "cancelled"). Results are written through one batched writer of `store`. The job stops as
    if cancelled when the store says it was cancelled or `should_stop()` is true, both asked
    about every CANCEL_POLL_SECONDS: nothing more is handed out, the pool stops the work in flight
    (`WorkerPool.cancel`), and what was measured by then is kept.

    A job whose spec says ``"allocation": "gradient"`` (a model's) has its budget handed to its
    tasks a slice at a time where the model's latency falls fastest (`_allocate`); any other runs
    its tasks one after the other, each to the budget it was created with."""
    rows = store.tasks(job_id)
    spec = (store.job(job_id) or {}).get("spec", {})
    for row in rows:
        metrics.set_task_progress(job_id, row["id"], store.trial_count(row["id"]), row["budget"])
    try:
        with store.writer() as writer:
            tasks = _Tasks(store, writer, job_id, pool, search, seed, batch_size, on_progress, stall_seconds,
                           should_stop, len(rows))
            try:
                if spec.get("allocation") == GRADIENT:
                    return _allocate(tasks, rows, spec)
                for number, row in enumerate(rows):
                    if tasks.run(number, row) == "cancelled":
                        return "cancelled"
                return "done"
            finally:
                tasks.close()
    finally:
        metrics.clear_job(job_id)


class _Tasks:
    """Runs a job's tasks, each to its budget, with the searches of the last KEEP_SEARCHES tasks kept
    between runs (a model job comes back to a task for each slice of its budget)."""

    def __init__(self, store: ResultStore, writer: ResultWriter, job_id: int, pool: WorkerPool, search: str,
                 seed: int, batch_size: int, on_progress: Callable[[Progress], None] | None, stall_seconds: float,
                 should_stop: Callable[[], bool], count: int) -> None:
        self.store, self.writer, self.job_id, self.pool = store, writer, job_id, pool
        self.search, self.seed, self.batch_size, self.count = search, seed, batch_size, count
        self.on_progress, self.stall_seconds, self.should_stop = on_progress, stall_seconds, should_stop
        self.devices: set[str] = set()  # the devices this job's trials ran on so far
        self._searches: dict[int, tuple[Task, ShardSearches]] = {}  # task id -> its searches, oldest first

    def run(self, number: int, row: dict[str, Any]) -> str:
        """Run task `row` (the `number`th of the job) to `row["budget"]`; "done" or "cancelled"."""
        return self.start(number, row).run(self.stall_seconds)

    def start(self, number: int, row: dict[str, Any], on_result: Callable[[], None] | None = None) -> _TaskLoop:
        """The loop that runs task `row` (the `number`th of the job) to `row["budget"]`, not yet run;
        `on_result` after each chunk."""
        task, searches = self._searches_of(row)
        job_id = self.job_id

        def report(done: int, best: float | None, last: list[MeasureResult]) -> None:
            self.devices.update(r.device for r in last if r.device)
            metrics.set_task_progress(job_id, row["id"], done, row["budget"])
            if best is not None:
                metrics.set_task_best(job_id, row["id"], workload_label(row["workload"], params=False), best,
                                      task.workload.flops() / best / 1e9)
            if on_result is not None:
                on_result()
            if self.on_progress is not None:
                self.on_progress(Progress(number, self.count, task, done, row["budget"], best, last))

        strategy, options = parse_search(self.search)
        return _TaskLoop(self.store, self.writer, job_id, row, task, self.pool, searches, self.batch_size, report,
                         self.store.trial_count(row["id"]), self.should_stop, guided=strategy.guided,
                         refresh=int(options.get("refresh", 0)))

    def _searches_of(self, row: dict[str, Any]) -> tuple[Task, ShardSearches]:
        if row["id"] in self._searches:
            self._searches[row["id"]] = self._searches.pop(row["id"])  # the newest now
            return self._searches[row["id"]]
        task = Task.from_json(row)
        while len(self._searches) >= KEEP_SEARCHES:
            self._searches.pop(next(iter(self._searches)))[1].close()
        start = time.monotonic()
        log.info("task %s: starting %s shard searches", row["id"], self.search)
        searches = self.pool.searches(self.search, task, self.seed, self.store.measured(row["id"]))
        log.info("task %s: %d shard searches (%s) started in %.1f s", row["id"], searches.count, self.search,
                 time.monotonic() - start)
        self._searches[row["id"]] = (task, searches)
        return task, searches

    def close(self) -> None:
        for _, searches in self._searches.values():
            searches.close()
        self._searches.clear()


def _allocate(tasks: _Tasks, rows: list[dict[str, Any]], spec: dict[str, Any]) -> str:
    """A model job (farm.core.allocation): the tasks given a budget at submission run to it first;
    then the rest of the job's budget goes to the others a slice (a round: workers x batch size, at
    least MIN_SLICE, less where the budget is too small to give each task one) at a time, each task's
    first slice in turn (smaller where the first slices would take more than WARMUP_SHARE of the
    budget), then where the model's latency is expected to fall most.

    Slices overlap: once a slice has handed out its whole budget (or its round of unguided configs,
    after which it waits for its task's first model), the next one starts, at most OPEN_SLICES at a
    time, so that the workers build the next task's candidates while they measure the last of the one
    before, and a device does not idle through a switch of tasks (docs/defaults.md#overlapping-slices).
    A task gets no new slice while one of its own is open.

    A task tuned before (its kernel, target and template version, by another job, on a device this
    job measures on) is not tuned again unless the spec says ``retune``: its fastest trial is copied
    into this job (origin ``reused``), so its export, status and the model's latency have it. Which
    records apply is decided by the devices the workers name; should none answer, the tasks that have
    such a record wait until this job's first trials say which devices it measures on."""
    store, job_id = tasks.store, tasks.job_id
    fixed = [row for row in rows if row["budget"] > 0]
    for number, row in enumerate(rows):
        if row["budget"] > 0 and tasks.run(number, row) == "cancelled":
            return "cancelled"
    free = [(number, row) for number, row in enumerate(rows) if row["budget"] == 0]
    prior = {row["id"]: [] if spec.get("retune") else _reusable(store, row) for _, row in free}
    if any(prior.values()):  # asked, not learnt from a first trial: a model whose every kernel has one runs none
        tasks.devices.update(tasks.pool.devices(DEVICE_NAME_SECONDS))
    free.sort(key=lambda item: bool(prior[item[1]["id"]]))  # those without a record first: they say the device
    states = [TaskState(row["weight"], Task.from_json(row).workload.flops(), row["family_key"]) for _, row in free]
    budget = int(store.job(job_id)["trials_budget"]) - sum(row["budget"] for row in fixed)
    # A slice is a round of the pool, at least MIN_SLICE, or less where the budget would not give
    # every task a first one. The first slices (one per task) take at most WARMUP_SHARE of the budget:
    # spread evenly, they would leave the gradient nothing to place where a small budget meets many
    # kernels (docs/defaults.md#warm-up-slices).
    slice_trials = max(1, min(max(MIN_SLICE, tasks.pool.size * tasks.batch_size), budget // max(1, len(states))))
    warmup_trials = max(1, min(slice_trials, int(budget * WARMUP_SHARE) // max(1, len(states))))
    allocation = GradientAllocation(states, budget, slice_trials, seed=tasks.seed, warmup_trials=warmup_trials)
    slices: dict[_TaskLoop, int] = {}  # each open slice's loop -> its task's index in `free`
    statuses: list[str] = []
    reported = [0.0]

    def reporter() -> None:  # the model's latency while a slice runs, at most every MODEL_REPORT_SECONDS
        if time.monotonic() - reported[0] >= MODEL_REPORT_SECONDS:
            reported[0] = time.monotonic()
            _report_model(store, job_id)

    def more() -> _TaskLoop | None:
        """The next slice's loop, if one may start now."""
        if "cancelled" in statuses or len(slices) >= OPEN_SLICES:
            return None
        if slices and (not tasks.devices or not all(loop.handed_out() for loop in slices)):
            return None  # the open slices still hand out work, or the job's devices are not known yet
        while (step := allocation.next()) is not None:
            index, grant = step
            number, row = free[index]
            if states[index].trials == 0 and (record := _on_devices(prior[row["id"]], tasks.devices)) is not None:
                _reuse(store, tasks.writer, row, record)
                allocation.reuse(index, record["latency"])
                log.info("task %s: %s reused from job %s (%.2f us on %s), not tuned again", row["id"],
                         workload_label(row["workload"], params=False), record["job_id"], record["latency"] * 1e6,
                         record["device"])
                continue
            row["budget"] += grant
            store.set_task_budget(row["id"], row["budget"])
            loop = tasks.start(number, row, on_result=reporter)
            slices[loop] = index
            return loop
        return None

    def ended(loop: _TaskLoop) -> None:
        index = slices.pop(loop)
        statuses.append(loop.status)
        if loop.status == "cancelled":
            return
        row = loop.row
        if loop.exhausted or loop.done < row["budget"]:  # its space ran out: the rest of the grant goes back
            row["budget"] = loop.done
            store.set_task_budget(row["id"], loop.done)
        allocation.observe(index, loop.done, loop.best, loop.exhausted)
        _report_model(store, job_id)

    _drive([], tasks.stall_seconds, more, ended)
    return "cancelled" if "cancelled" in statuses else "done"


def _report_model(store: ResultStore, job_id: int) -> None:
    """The model's estimated latency, to the metrics, once every kernel has a correct trial."""
    job = store.job(job_id)
    latency = model_latency(model_kernels(job["tasks"])) if job is not None else None
    if latency is not None:
        metrics.set_model_latency(job_id, latency)


def _reusable(store: ResultStore, row: dict[str, Any]) -> list[dict[str, Any]]:
    """Earlier jobs' fastest trials of the task's kernel on its target with its template's version."""
    return [r for r in store.prior_best(row["workload_key"], row["target_kind"], exclude_job=row["job_id"])
            if r["target"] == row["target"] and r["template"] == row["template"]
            and r["template_version"] == row["template_version"]]


def _on_devices(records: list[dict[str, Any]], devices: set[str]) -> dict[str, Any] | None:
    """The fastest of `records` measured on one of `devices` (None if none, or no device known yet)."""
    return next((r for r in records if r["device"] in devices), None)


def _reuse(store: ResultStore, writer: ResultWriter, row: dict[str, Any], record: dict[str, Any]) -> None:
    """Copy an earlier job's trial into task `row` as its one trial (origin ``reused``)."""
    fields = ("config_index", "config", "error", "latencies", "build_seconds", "run_seconds", "device", "worker",
              "shard", "round", "timeline")
    result = MeasureResult(status=Status.OK, origin=REUSED, **{k: record[k] for k in fields})
    result.timeline = result.timeline or {}
    writer.record(row["id"], result)
    writer.flush()
    row["budget"] = 1
    store.set_task_budget(row["id"], 1)


@dataclass
class _Chunk:
    """Configs of one shard handed to one worker in one call."""

    worker: int
    shard: int
    indices: list[int]
    origins: dict[int, str]  # index -> what proposed it (SearchStrategy.origin), stored with its trial
    round: int
    attempt: int


class _TaskLoop:
    """One task's loop (see the module docstring): its state, and what each event does to it.

    Everything here runs in the caller's thread; only the retraining runs in a thread of its own.
    """

    def __init__(self, store: ResultStore, writer: ResultWriter, job_id: int, row: dict[str, Any], task: Task,
                 pool: WorkerPool, searches: ShardSearches, batch_size: int,
                 report: Callable[[int, float | None, list[MeasureResult]], None], done: int,
                 should_stop: Callable[[], bool], guided: bool = False, refresh: int = 0) -> None:
        """`guided`: whether the searches follow the cost model (the first model's wait, module
        docstring); `refresh`: results between refreshes of the model (0: none; module docstring)."""
        self.store, self.writer, self.job_id, self.row, self.task = store, writer, job_id, row, task
        self.should_stop = should_stop
        self.pool, self.searches, self.report = pool, searches, report
        self.task_id, self.budget, self.done = row["id"], row["budget"], done
        self.batch_size = batch_size
        self.chunk = min(CHUNK, batch_size)
        # Candidates each worker keeps in flight: at most QUEUE_DEPTH batches, fewer where its builds
        # keep up with its device (a fresher model proposes them).
        self.leads = [Lead(self.chunk, QUEUE_DEPTH * batch_size) for _ in range(pool.size)]
        self.round_size = pool.size * batch_size
        self.best = min((b["latency"] for b in store.best(self.task_id, 1)), default=None)
        self.round = len(store.rounds(self.task_id))
        # A task of a template and target kind tuned before starts from the family's model.
        self.current = starting_model(store, row)
        searches.set_model(self.current)
        self.in_flight = [0] * pool.size  # candidates being proposed for, or handed to, each worker
        self.returned = [False] * pool.size  # whether each worker has returned results in this task
        # Since when each worker has returned no result and been handed no stand-in (None: no result yet).
        self.quiet_since: list[float | None] = [None] * pool.size
        # A worker's first batch of a task goes out one candidate per call, so the first result is
        # stored as soon as any one of them has compiled, not the slowest of a chunk: the first,
        # unguided configs take very different times to compile, and a batch (16) compiles at once
        # on a GPU host's 16 build slots (docs/defaults.md#chunk).
        self.singles = [batch_size] * pool.size  # single-candidate chunks still to hand each worker
        self.proposals: dict[cf.Future[Proposal], tuple[int, int]] = {}  # -> (worker, n)
        self.running: dict[cf.Future[list[MeasureResult]], _Chunk] = {}
        self.retry: list[_Chunk] = []  # chunks whose worker died: to measure again
        self.round_results: list[MeasureResult] = []
        self.retraining: cf.Future[Retrained] | None = None
        self.refresh = refresh
        self.refreshing: cf.Future[StoredModel | None] | None = None
        self.since_training = 0  # results since the last training (a round's or a refresh) began
        self.refreshes = 0
        self.closing: tuple[int, int, float | None, int | None] = (0, 0, None, None)  # round, done, best, guide
        self.round_started = self.started_at = time.monotonic()
        self.first_results_at: float | None = None  # this run's (a model job's slice's) first results
        self.last_retraining_s = 0.0  # this run's wait for its last round's retraining, once its budget was in
        self.retraining_waited_from: float | None = None
        # The job's other open slices (a model job's, _allocate): each worker's room is shared with them.
        self.peers: Callable[[], list[_TaskLoop]] = list
        self.exhausted = False
        self.no_worker_since: float | None = None  # since when no worker could take work
        self.cancelled = self._stopped()
        self.stop_by = time.monotonic()  # once cancelled: how long its chunks in flight are waited for
        self._trainer = DaemonExecutor("farm-retrain")  # a stopped process does not wait for it
        # Unguided configs of the round still to hand out before the wait for a model, 0 while it is
        # waited for; None: no wait (a search that needs no model, or a model there already). Each
        # worker's bridge (module docstring): the unguided configs it may still get while it waits.
        self.unguided_left: int | None = None
        self.bridge_left = [0] * pool.size
        if guided and not self._has_model():
            self.unguided_left = self.round_size
            self._trainer.submit(warm_up, task)  # in the retraining's thread, ahead of its first

    def run(self, stall_seconds: float) -> str:
        """Run the task to its budget; "done" or "cancelled"."""
        _drive([self], stall_seconds)
        return self.status

    # --- the loop's steps, driven by _drive, alone or beside a model job's other slices ---

    @property
    def status(self) -> str:
        return "cancelled" if self.cancelled else "done"

    def settle(self, stall_seconds: float) -> bool:
        """Hand out what there is room for and close what is due; True once the task's run has ended
        (budget measured and its last round retrained, space exhausted, or stopped)."""
        if self.cancelled and (not self.running or time.monotonic() >= self.stop_by):
            return True  # the chunks still out are left: the pool stopped them, nothing waits for them
        self._fill()
        if not (self._complete() or (not self.proposals and not self.running)):
            self.no_worker_since = None
            return False
        if not (self._complete() or self.cancelled or self._waiting_for_model() or self._all_handed_out()):
            # Work is left, but nothing could be handed out: no worker can take work, or (a model job's
            # overlapping slices) every worker's room is taken by another slice, whose results free it.
            if not any(self.pool.ready(w) for w in range(self.pool.size)):
                self._wait_for_a_worker(stall_seconds)
            return False
        if self.retraining is not None:  # waited for among the loop's futures
            if self.retraining_waited_from is None:
                self.retraining_waited_from = time.monotonic()
            return False
        if self.round_results:
            self._close_round()  # the last, partial round
            return False
        return True

    def handed_out(self) -> bool:
        """Whether a model job's next slice may start beside this one: its budget all handed out, its
        space exhausted, stopped, or its unguided round handed out. From then on it waits for its first
        model, handing out at most its bridge, and only once most of the round is measured (the bridge
        is kept to BRIDGE_CHUNKS chunks in flight): a next slice that waited for the bridge too would
        start building with a few candidates left to measure, the device idle through its first builds."""
        return self.cancelled or self._all_handed_out() or self.unguided_left == 0

    def _all_handed_out(self) -> bool:
        """Whether the budget is all handed out (none to measure again), or the space exhausted."""
        return not self.retry and (self.exhausted or self._left() <= 0)

    def waiting(self) -> list[cf.Future[Any]]:
        """The futures whose ends move the loop on."""
        waiting: list[cf.Future[Any]] = [*self.proposals, *self.running]
        return waiting + [f for f in (self.retraining, self.refreshing) if f is not None]

    def wake(self) -> float | None:
        """Seconds until the loop must look again with nothing finished (an end-game grace); None: never."""
        return self._end_game_wake()

    def poll(self) -> None:
        """Ask whether the job must stop; take in the workers that joined."""
        self._poll_stop()
        if not self.cancelled:  # stopping: Ray itself may be going (a signal to the process group)
            self._grow()

    def advance(self, finished: set[cf.Future[Any]]) -> None:
        """Take in the loop's futures among `finished`; close the round or refresh the model when due."""
        for future in [*self.proposals, *self.running, self.retraining, self.refreshing]:
            if future is None or future not in finished:
                continue
            if future is self.retraining:
                self._retrained()
            elif future is self.refreshing:
                self._refreshed()
            elif future in self.proposals:
                self._proposed(future)
            elif future in self.running:  # not one the stop dropped meanwhile
                self._measured(future)
        if len(self.round_results) >= self.round_size:
            self._close_round()
        elif self._refresh_due():
            self._refresh()

    def finish(self) -> None:
        """End the run: stop its retraining thread, and log where its time went."""
        # A stopped task does not wait for a retraining under way: its model is saved if the
        # process lives on (a service), and an exiting process does not wait for it either.
        self._trainer.shutdown(wait=not self.cancelled, cancel_futures=True)
        if self.refresh:
            log.info("task %s: cost model refreshed %d times between rounds", self.task_id, self.refreshes)
        first = f"{self.first_results_at - self.started_at:.1f} s" if self.first_results_at is not None else "never"
        log.info("task %s: ran to %d trials in %.1f s: first results after %s, %.1f s waiting for its last "
                 "retraining", self.task_id, self.done, time.monotonic() - self.started_at, first,
                 self.last_retraining_s)

    def _stopped(self) -> bool:
        return self.should_stop() or self.store.job_status(self.job_id) == "cancelled"

    def _poll_stop(self) -> None:
        """If the job must stop now (cancelled, or `should_stop`): hand out nothing more, drop the
        proposals under way, stop the pool's work in flight, and wait for it STOP_GRACE_SECONDS at most."""
        if self.cancelled or not self._stopped():
            return
        self.cancelled = True
        self.proposals.clear()
        self.pool.cancel()
        self.stop_by = time.monotonic() + STOP_GRACE_SECONDS
        log.info("task %s: stopping (cancelled or interrupted); %d chunks in flight", self.task_id, len(self.running))

    # --- handing out work ---------------------------------------------------------------

    def _left(self) -> int:
        """Trials of the budget not yet measured, handed out or waiting to be handed out again."""
        return self.budget - self.done - sum(self.in_flight) - sum(len(c.indices) for c in self.retry)

    def _room(self, worker: int) -> int:
        """Candidates `worker` may still be given: its lead less what it has in flight (for this task and
        the job's other open slices), or less while the first model is waited for: the bridge's (module
        docstring)."""
        room = self.leads[worker].size - self.in_flight[worker] - self._others(worker)
        if self.unguided_left == 0:
            room = min(room, BRIDGE_CHUNKS * self.chunk - self.in_flight[worker], self.bridge_left[worker])
        return room

    def _waiting_for_model(self) -> bool:
        """Whether nothing may be handed out until the first model arrives: its round and the bridges of
        the workers that can take work handed out."""
        return self.unguided_left == 0 and not any(left for w, left in enumerate(self.bridge_left)
                                                   if self.pool.ready(w))

    def _roomiest(self) -> int | None:
        """The worker with the fewest candidates in flight, if it has room for more: filling the
        emptiest first gives every worker work before any gets more, and spreads a budget's
        last trials over all of them."""
        ready = [w for w in range(len(self.in_flight)) if self.pool.ready(w)]
        worker = min(ready, key=lambda w: self.in_flight[w] + self._others(w), default=None)
        return worker if worker is not None and self._room(worker) > 0 else None

    def _others(self, worker: int) -> int:
        """Candidates the job's other open slices have in flight on `worker`."""
        return sum(p.in_flight[worker] for p in self.peers() if worker < len(p.in_flight))

    def _last_heard(self, worker: int) -> float:
        """When `worker` last returned results, or was handed stand-ins, in this slice or another open
        one (time.monotonic): a device that returns nothing to any of them is idle, whatever they
        have in flight on it (their last candidates may all be slow builds)."""
        return max(p.quiet_since[worker] or 0.0 for p in [self, *self.peers()] if worker < len(p.quiet_since))

    def _fill(self) -> None:
        """Hand out work until every worker is full or the budget is all handed out."""
        if self.cancelled:
            return
        while self.retry and (worker := self._roomiest()) is not None:
            chunk = self.retry.pop(0)
            self._submit(worker, chunk.shard, list(chunk.origins.items()), chunk.attempt + 1)
        while not self.exhausted and (left := self._left()) > 0 and (worker := self._roomiest()) is not None:
            n = min(self.chunk, left, self._room(worker))
            if self.singles[worker]:
                n = 1
                self.singles[worker] -= 1
            if self.unguided_left == 0:
                self.bridge_left[worker] -= n
            elif self.unguided_left:
                n = min(n, self.unguided_left)
                self.unguided_left -= n
                if not self.unguided_left:
                    log.info("task %s: a round of unguided configs handed out; waiting for the cost model",
                             self.task_id)
                    self.bridge_left = [BRIDGE_CHUNKS * self.chunk] * len(self.in_flight)
            self._propose(worker, n)
        for worker in self._stand_ins():
            # All the budget lacks, as far as the worker has room: one grace, not one per chunk.
            n = min(self.leads[worker].size, self.budget - self.done)
            log.info("task %s: %s idle at the budget's end, measuring %d new configs in place of the %d still out",
                     self.task_id, self.pool.names[worker], n, sum(self.in_flight))
            self.quiet_since[worker] = time.monotonic()  # another grace before it stands in again
            self._propose(worker, n)

    def _propose(self, worker: int, n: int) -> None:
        """Ask `worker`'s shard search for `n` configs, handed to the worker once proposed."""
        (future,) = self.searches.propose([(self._shard(worker), n)])
        self.proposals[future] = (worker, n)
        self.in_flight[worker] += n

    def _complete(self) -> bool:
        """Whether the budget is all measured: what is still out then is the end game's, not waited for."""
        return self.done >= self.budget

    def _end_game(self) -> bool:
        """Whether the task is in its end game (module docstring): its budget all handed out, none
        of it to measure again, some still out, and all of that with workers that have returned
        results in the task."""
        if self.cancelled or self.exhausted or self.retry or self._left() > 0 or self._complete():
            return False
        out = [w for w, n in enumerate(self.in_flight) if n]
        return bool(out) and all(self.returned[w] for w in out)

    def _idle(self) -> dict[int, float]:
        """In the end game, the workers that may stand in (ready, results returned) and the seconds
        each has returned nothing (no result, no stand-in handed to it) to this slice or another open
        one: idle, or waiting on slow builds (its own, or the last of every open slice's) while its
        device idles; none outside it."""
        if not self._end_game():
            return {}
        now = time.monotonic()
        return {w: now - self._last_heard(w) for w, since in enumerate(self.quiet_since) if since is not None
                and self.returned[w] and self.pool.ready(w)}

    def _stand_ins(self) -> list[int]:
        """The workers that stand in for the last chunks out now: quiet END_GAME_GRACE seconds."""
        return [w for w, idle in self._idle().items() if idle >= END_GAME_GRACE]

    def _end_game_wake(self) -> float | None:
        """Seconds until the next worker's grace ends, in the end game; None if none is waiting."""
        idle = self._idle().values()
        return max(0.0, END_GAME_GRACE - max(idle)) if idle else None

    def _shard(self, worker: int) -> int:
        """The shard worker `worker` searches: its own, or an earlier worker's if it joined later."""
        return worker % self.searches.count

    def _wait_for_a_worker(self, stall_seconds: float) -> None:
        """Every worker is down (their nodes left the cluster): wait a second for one to come back
        or join; after `stall_seconds` of none, the job fails saying so."""
        if self.no_worker_since is None:
            self.no_worker_since = time.monotonic()
            log.warning("task %s: no worker can measure (every device left the cluster); waiting for one",
                        self.task_id)
        elif time.monotonic() - self.no_worker_since > stall_seconds:
            raise FarmError(f"no worker could measure for {stall_seconds:.0f} s: every device of the job left "
                            "the cluster; the trials measured are kept (submit the job again to finish it)")
        time.sleep(CANCEL_POLL_SECONDS)
        self._poll_stop()
        self._grow()

    def _grow(self) -> None:
        """Hand work to the workers that joined the pool (see the module docstring), whichever of the
        job's open slices asked the pool."""
        self.pool.grow()
        added = self.pool.size - len(self.in_flight)
        if added > 0:
            self.in_flight += [0] * added
            self.returned += [False] * added
            self.quiet_since += [None] * added
            self.bridge_left += [0] * added
            self.singles += [self.batch_size] * added
            self.leads += [Lead(self.chunk, QUEUE_DEPTH * self.batch_size) for _ in range(added)]
            self.round_size = self.pool.size * self.batch_size
            log.info("task %s: %d worker(s) joined, %d measuring now", self.task_id, added, self.pool.size)

    def _submit(self, worker: int, shard: int, proposed: Proposal, attempt: int) -> None:
        indices = [index for index, _ in proposed]
        future = self.pool.dispatch(worker, self.task, indices, shard, self.round)
        self.running[future] = _Chunk(worker, shard, indices, dict(proposed), self.round, attempt)
        self.in_flight[worker] += len(indices)

    # --- events -------------------------------------------------------------------------

    def _proposed(self, future: cf.Future[Proposal]) -> None:
        worker, n = self.proposals.pop(future)
        self.in_flight[worker] -= n
        shard, proposed = self._shard(worker), future.result()
        if not proposed:  # work stealing: the first shard with configs left
            shard, proposed = _steal(self.searches, n)
        if not proposed:
            if not self.exhausted:
                log.info("task %s: space exhausted after %d trials", self.task, self.done)
            self.exhausted = True
            return
        self._submit(worker, shard, proposed, 1)

    def _measured(self, future: cf.Future[list[MeasureResult]]) -> None:
        chunk = self.running.pop(future)
        self.in_flight[chunk.worker] -= len(chunk.indices)
        if self._complete():  # the end game's: the budget was completed by others
            return
        try:
            results = future.result()
        except FarmError:  # the worker cannot measure at all (its device never came up): the job fails
            raise
        except Exception as e:  # the worker failed as a whole: the farm's fault, not the candidates'
            name = self.pool.names[chunk.worker]
            if chunk.attempt < MAX_ATTEMPTS:
                log.warning("worker %s failed on %d candidates of %s (%s); measuring them again", name,
                            len(chunk.indices), self.task, one_line(e))
                self.retry.append(chunk)
                return
            log.warning("worker %s failed on %d candidates of %s for the %d. time (%s); recording them as failed",
                        name, len(chunk.indices), self.task, chunk.attempt, one_line(e))
            results = [MeasureResult(i, self.task.config(i).to_json(), Status.RUNTIME_ERROR,
                                     f"worker failed {chunk.attempt} times: {one_line(e)}", worker=name,
                                     shard=chunk.shard, round=chunk.round) for i in chunk.indices]
        self.returned[chunk.worker] = True
        self.leads[chunk.worker].observe(results)
        self.quiet_since[chunk.worker] = time.monotonic()
        if self.first_results_at is None:
            # Start-up's end (or a slice's), for `farm tune -v` and the service's log: what a user waits for.
            self.first_results_at = time.monotonic()
            log.info("task %s: first results %.1f s after its searches started", self.task_id,
                     self.first_results_at - self.started_at)
        results = results[: self.budget - self.done]  # an end game's chunk or the one it stood in for: the first
        for r in results:
            r.origin = chunk.origins.get(r.config_index, "")
            self.writer.record(self.task_id, r)
        self.searches.observe(chunk.shard, results)
        self.round_results.extend(results)
        self.since_training += len(results)
        self.done += len(results)
        self.best = _best(self.best, results)
        self.report(self.done, self.best, results)

    # --- rounds -------------------------------------------------------------------------

    def _close_round(self) -> None:
        """Start retraining on the round's results (one retraining at a time: a round that
        fills up while one runs closes when it has finished)."""
        if self.retraining is not None or not self.round_results:
            return
        self.writer.flush()  # the retraining reads every trial of the family from the store
        # The model the round's rank correlation scores is the one that guided it.
        self.closing = (self.round, self.done, self.best, self.current.model_id if self.current else None)
        self.retraining = self._trainer.submit(retrain, self.store, self.row, self.task, self.current,
                                               self.round_results)
        self.round, self.round_results, self.since_training = self.round + 1, [], 0

    def _refresh_due(self) -> bool:
        """Whether to refresh the model now: asked for, a model to refresh, `refresh` results since the
        last training began, the training thread idle, and configs still to hand out."""
        return bool(self.refresh and self.retraining is None and self.refreshing is None and self._has_model()
                    and self.since_training >= self.refresh and self._left() > 0 and not self.cancelled)

    def _refresh(self) -> None:
        self.writer.flush()  # the training reads every trial of the family from the store
        self.since_training = 0
        self.refreshing = self._trainer.submit(refreshed, self.store, self.row, self.task)

    def _refreshed(self) -> None:
        """Hand the refreshed model to the searches, unless a round's retraining began since: its
        model, from more trials, replaces it anyway. The round keeps `current` (the saved model it
        started with) for its record."""
        assert self.refreshing is not None
        model = self.refreshing.result()
        self.refreshing = None
        if model is not None and self.retraining is None:
            self.searches.set_model(model)
            self.refreshes += 1

    def _retrained(self) -> None:
        assert self.retraining is not None
        trained = self.retraining.result()
        self.retraining = None
        if self.retraining_waited_from is not None:
            self.last_retraining_s += time.monotonic() - self.retraining_waited_from
            self.retraining_waited_from = None
        round_, done, best, guided_by = self.closing
        metrics.observe_retrain(self.job_id, self.task_id, trained.training_seconds, trained.rank_corr)
        metrics.observe_round(self.task.target.kind, time.monotonic() - self.round_started)
        self.round_started = time.monotonic()
        self.current = trained.current
        self.searches.set_model(self.current)
        self.store.add_round(self.task_id, round_, done, best, trained.rank_corr, guided_by)
        if self.unguided_left is not None:  # the wait for a first model: over, or another round
            self.unguided_left = None if self._has_model() else self.round_size

    def _has_model(self) -> bool:
        """Whether the searches have a trained model to follow."""
        return self.current is not None and self.current.model.trained


def _drive(loops: list[_TaskLoop], stall_seconds: float, more: Callable[[], _TaskLoop | None] = lambda: None,
           ended: Callable[[_TaskLoop], None] = lambda loop: None) -> None:
    """Run the task loops of `loops` together in this thread, each fed by the events of its own futures,
    until every one has ended (`ended(loop)` after each, once it is finished). `more()`, asked after each
    event, may open another loop (a model job's next slice: _allocate), which shares the workers' room with
    the others. Every loop still open is finished however this ends."""
    polled = last_event = time.monotonic()

    def peers(me: _TaskLoop) -> Callable[[], list[_TaskLoop]]:
        return lambda: [loop for loop in loops if loop is not me]

    for loop in loops:
        loop.peers = peers(loop)
    try:
        while True:
            for loop in [loop for loop in loops if loop.settle(stall_seconds)]:
                loops.remove(loop)
                loop.finish()
                ended(loop)
            if (new := more()) is not None:
                new.peers = peers(new)
                loops.append(new)
                continue
            if not loops:
                return
            waiting = [future for loop in loops for future in loop.waiting()]
            # Waking to ask whether to stop, and for the end game, when a worker's grace ends.
            wake = max(0.0, polled + CANCEL_POLL_SECONDS - time.monotonic())
            wake = min([wake, *(w for loop in loops if (w := loop.wake()) is not None)])
            finished, _ = cf.wait(waiting, timeout=wake, return_when=cf.FIRST_COMPLETED)
            if time.monotonic() - polled >= CANCEL_POLL_SECONDS:
                polled = time.monotonic()
                for loop in loops:
                    loop.poll()
            if not finished:
                if time.monotonic() - last_event >= stall_seconds:
                    # The watchdog: say so and keep waiting (a hang ends as a timeout result).
                    log.warning("tasks %s: nothing finished in %.0f s (%d chunks running)",
                                ", ".join(str(loop.task) for loop in loops), stall_seconds,
                                sum(len(loop.running) for loop in loops))
                    last_event = time.monotonic()
                continue
            last_event = time.monotonic()
            for loop in loops:
                loop.advance(finished)
            _queue_metrics(loops)
    finally:
        for loop in loops:
            loop.finish()


def _queue_metrics(loops: list[_TaskLoop]) -> None:
    """Per worker: candidates handed to it (in flight) and those its searches are proposing (queued)."""
    pool = loops[0].pool
    handed, queued = [0] * pool.size, [0] * pool.size
    for loop in loops:
        for chunk in loop.running.values():
            handed[chunk.worker] += len(chunk.indices)
        for worker, n in loop.proposals.values():
            queued[worker] += n
    for worker, name in enumerate(pool.names):
        metrics.set_worker_queue(name, handed[worker], queued[worker])


def _steal(searches: ShardSearches, n: int) -> tuple[int, Proposal]:
    """(shard, proposal) from the first shard with configs left; an empty proposal when all are out."""
    for shard in range(searches.count):
        (future,) = searches.propose([(shard, n)])
        proposed = future.result()
        if proposed:
            return shard, proposed
    return 0, []


def _best(best: float | None, results: list[MeasureResult]) -> float | None:
    for r in results:
        if r.latency is not None and (best is None or r.latency < best):
            best = r.latency
    return best
