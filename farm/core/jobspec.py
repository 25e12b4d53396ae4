"""Job requests: what a user submits, validated and turned into the rows the store keeps.

`farm tune`, `farm submit` and `farm.Client.submit` all go through `JobRequest`, so a job
is checked the same way wherever it comes from, before anything is written. `job_row()` is
what `ResultStore.create_job` takes; the core itself writes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from farm.core.errors import FarmError, brief
from farm.core.search import parse_search
from farm.core.targets import TargetSpec, parse_target
from farm.core.task import Task
from farm.core.templates import templates_for
from farm.core.workloads import Workload, make_workload

# Bounds on a job, the same whatever database holds it. The trial budget is stored in 32-bit
# INTEGER columns on Postgres (SQLite would take more, so the bound is the farm's, not the
# database's): 10^9 trials is also far beyond any tuning job (a million is days of GPU time).
MAX_TRIALS = 10**9
MAX_WORKLOADS = 1000
# Worker actors (one per device) a job may ask for; a larger number is a typo, not a fleet.
MAX_WORKERS = 1024
MAX_BATCH_SIZE = 4096
# Seeds feed numpy's generators, which take unsigned integers.
MAX_SEED = 2**32 - 1
# Names and RPC keys are stored in VARCHAR(200) columns and printed on one line.
MAX_NAME_CHARS = 200
# What templates a job tunes each kernel with (JobRequest.build).
TEMPLATE_CHOICES = ("best", "all")
# How a job's budget reaches its tasks: split evenly when it is created, or handed out a slice at a
# time where a model's latency falls fastest (farm.core.allocation, scheduler.tuner).
ALLOCATIONS = ("even", "gradient")
# Calls of one kernel per inference: a model's layers are counted, not its loop iterations.
MAX_WEIGHT = 10**6
# An RPC key names a device queue at the TVM tracker: no spaces, colons or control characters.
RPC_KEY = re.compile(r"[A-Za-z0-9._@+-]{1,200}", re.ASCII)


def family_key(task: Task) -> str:
    """Tasks whose trials can train one cost model: same template at the same version, target
    kind, workload family (`Workload.family`: its name, or a TIR kernel's shape-free structure).
    The version (a hash of the template's source, `Template.version`) is part of it because a
    changed template can make other kernels of the same knob values (as real cp.async did of
    every `pipeline` >= 2 config): trials of the old kernels would teach the model latencies the
    new ones do not have."""
    return f"{task.template.name}@{task.template.version}|{task.target.kind}|{task.workload.family}"


@dataclass
class JobRequest:
    """A validated job: tasks (workload x target), a trial budget spread over them, how to search."""

    workloads: list[Workload]
    target: TargetSpec
    trials: int
    search: str = "xgb"
    workers: int = 1
    seed: int = 0
    batch_size: int = 16
    rpc_keys: list[str] = field(default_factory=list)
    name: str = ""
    templates: str = "best"
    weights: list[int] = field(default_factory=list)
    budgets: list[int | None] = field(default_factory=list)
    allocation: str = "even"
    retune: bool = False
    model: dict[str, Any] | None = None

    @classmethod
    def build(cls, workloads: Sequence[str | Workload | tuple[str, dict[str, Any]]],
              target: str | dict[str, Any] | TargetSpec, trials: int, *, search: str = "xgb", workers: int = 1,
              seed: int = 0, batch_size: int = 16, rpc_keys: Sequence[str] = (), name: str = "",
              templates: str = "best", weights: Sequence[int] | None = None,
              budgets: Sequence[int | None] | None = None, allocation: str = "even", retune: bool = False,
              model: dict[str, Any] | None = None) -> JobRequest:
        """Validate everything (raises FarmError with one clear line) and return the request.

        The one place a job spec is checked, before anything is written: a workload is a
        Workload, a preset or workload name, or (name, {param: value}) (each checked by
        farm.core.workloads, extents included); `target` by farm.core.targets.parse_target;
        `trials` an int in [number of workloads, MAX_TRIALS]; `search` a spec that
        farm.core.search.parse_search accepts; `workers` in [1, MAX_WORKERS];
        `batch_size` in [1, MAX_BATCH_SIZE]; `seed` in [0, MAX_SEED]; `rpc_keys` a list of
        distinct keys matching RPC_KEY (at most MAX_WORKERS); `name` at most MAX_NAME_CHARS
        printable characters; `templates` one of TEMPLATE_CHOICES: ``best``, each kernel tuned
        with its preferred template, ``all``, with every template that schedules it (a TIR kernel
        whose main computation is one of the farm's operators: its hand template and its design
        space), one task each, the export keeping the faster. Every task must have a template whose
        space is within farm.core.space's bounds. Booleans are not integers here, nor a string a list.

        A model's job (farm.core.model) gives each workload its `weights` (calls per inference, in
        [1, MAX_WEIGHT]), may fix some tasks' `budgets` (None: the allocation's to give), and says
        how the rest of the budget reaches them (`allocation`, one of ALLOCATIONS: ``gradient`` hands
        it out as results come in), whether kernels tuned before are tuned again (`retune`), and
        `model`, what the job's spec records of the model (name, hash, inputs).

        Nothing here imports TVM (seconds in a fresh process): targets are checked against the
        farm's table of TVM's attributes, spaces sized from the workloads' own extents.
        """
        wls = [_workload(w) for w in _sequence(workloads, "workloads", MAX_WORKLOADS)]
        if not wls:
            raise FarmError("a job needs at least one workload")
        spec = parse_target(target)
        _integer(trials, "trials", 1, MAX_TRIALS)
        _integer(workers, "workers", 1, MAX_WORKERS)
        _integer(batch_size, "batch size", 1, MAX_BATCH_SIZE)
        _integer(seed, "seed", 0, MAX_SEED)
        if templates not in TEMPLATE_CHOICES:
            raise FarmError(f"templates must be one of {', '.join(TEMPLATE_CHOICES)}, got {brief(templates)}")
        parse_search(search)
        keys = [_rpc_key(key) for key in _sequence(rpc_keys, "rpc_keys", MAX_WORKERS)]
        if len(set(keys)) != len(keys):
            raise FarmError(f"rpc_keys {brief(keys)} name a device twice")
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or not name.isprintable():
            raise FarmError(f"a job name is at most {MAX_NAME_CHARS} printable characters, got {brief(name)}")
        if allocation not in ALLOCATIONS:
            raise FarmError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {brief(allocation)}")
        weights = list(weights) if weights is not None else [1] * len(wls)
        budgets = list(budgets) if budgets is not None else [None] * len(wls)
        if len(weights) != len(wls) or len(budgets) != len(wls):
            raise FarmError(f"give one weight and one budget per workload ({len(wls)}), got {len(weights)} and "
                            f"{len(budgets)}")
        for weight in weights:
            _integer(weight, "a task's weight", 1, MAX_WEIGHT)
        for budget in budgets:
            if budget is not None:
                _integer(budget, "a task's budget", 1, MAX_TRIALS)
        fixed = sum(b for b in budgets if b is not None)
        if fixed > trials:
            raise FarmError(f"the tasks' own budgets add up to {fixed:,} trials, more than the job's {trials:,}")
        if any(b is not None for b in budgets) and allocation != "gradient":
            raise FarmError("tasks' own budgets need the gradient allocation, which gives the rest to the others")
        if not isinstance(retune, bool):
            raise FarmError(f"retune must be true or false, got {brief(retune)}")
        request = cls(wls, spec, trials, search, workers, seed, batch_size, keys,
                      name or ("tune " + ", ".join(str(w) for w in wls))[:MAX_NAME_CHARS], templates,
                      weights, budgets, allocation, retune, model)
        if trials < len(request.tasks):
            raise FarmError(f"{trials} trials cannot cover {len(request.tasks)} tasks: give at least one each")
        for task in request.tasks:
            # FarmError when no template exists for the target, or its space is out of bounds.
            task.space  # noqa: B018
        return request

    @cached_property
    def tasks(self) -> list[Task]:
        """One task per workload, or with templates ``all`` one per template that schedules it."""
        return [task for task, _ in self._tasks]

    @cached_property
    def _tasks(self) -> list[tuple[Task, int]]:
        """Each task with the index of its workload."""
        if self.templates == "best":
            return [(Task(w, self.target), i) for i, w in enumerate(self.workloads)]
        return [(Task(w, self.target, t.name), i) for i, w in enumerate(self.workloads)
                for _, t in templates_for(w, self.target)]

    def spec(self) -> dict[str, Any]:
        """The job's spec as stored: enough to run it again anywhere."""
        spec = {"workloads": [w.to_json() for w in self.workloads], "target": self.target.to_json(),
                "trials": self.trials, "search": self.search, "workers": self.workers, "seed": self.seed,
                "batch_size": self.batch_size, "rpc_keys": self.rpc_keys, "templates": self.templates}
        if self.allocation != "even":
            spec.update(allocation=self.allocation, weights=self.weights, budgets=self.budgets, retune=self.retune)
        if self.model is not None:
            spec["model"] = self.model
        return spec

    def task_rows(self) -> list[dict[str, Any]]:
        """One row per task. Evenly allocated, the job's budget is split as evenly as possible over
        them; by gradient, a task has the budget given for its kernel (split over its templates)
        and the others none yet (the scheduler hands them theirs)."""
        base, extra = divmod(self.trials, len(self.tasks))
        per_kernel = [sum(1 for _, j in self._tasks if j == i) for i in range(len(self.workloads))]
        rows = []
        for n, (t, i) in enumerate(self._tasks):
            if self.allocation == "even":
                budget = base + (1 if n < extra else 0)
            else:
                given = self.budgets[i] or 0
                first = next(k for k, (_, j) in enumerate(self._tasks) if j == i)
                budget = given // per_kernel[i] + (1 if n - first < given % per_kernel[i] else 0)
            rows.append({
                "workload": t.workload.to_json(), "workload_key": t.workload.key,
                "target": t.target.to_json(), "target_kind": t.target.kind,
                "template": t.template.name, "template_version": t.template.version,
                "space_size": t.space.size, "budget": budget, "family_key": family_key(t),
                "weight": self.weights[i],
            })
        return rows

    def job_row(self) -> dict[str, Any]:
        """The keyword arguments of `ResultStore.create_job` that queue this job and its tasks."""
        return {"name": self.name, "spec": self.spec(), "trials_budget": self.trials, "search": self.search,
                "tasks": self.task_rows()}


def _sequence(value: Any, what: str, limit: int) -> Sequence[Any]:
    """`value` if it is a list or tuple of at most `limit` items; a string is not a list of keys."""
    if not isinstance(value, list | tuple):
        raise FarmError(f"{what} must be a list, got {type(value).__name__} {brief(value)}")
    if len(value) > limit:
        raise FarmError(f"{what} has {len(value):,} entries; a job takes at most {limit:,}")
    return value


def _workload(item: Any) -> Workload:
    if isinstance(item, Workload):
        return item
    if type(item).__name__ in ("PrimFunc", "IRModule"):  # any TIR kernel (TVM is imported if so)
        from farm.core.tir import tir_workload

        return tir_workload(item)
    if isinstance(item, str):
        return make_workload(item)
    if isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[1], Mapping):
        return make_workload(item[0], item[1])
    raise FarmError(f"a workload is a name, a Workload or (name, {{param: value}}), got {brief(item)}")


def _integer(value: Any, what: str, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise FarmError(f"{what} must be an integer in [{low:,}, {high:,}], got {brief(value)}")


def _rpc_key(key: Any) -> str:
    if not isinstance(key, str) or not RPC_KEY.fullmatch(key):
        raise FarmError(f"RPC key {brief(key)} must be 1 to 200 letters, digits or ._@+- characters")
    return key
