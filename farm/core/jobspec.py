"""Job requests: what a user submits, validated and turned into the rows the store keeps.

`farm tune`, `farm submit` and `farm.Client.submit` all go through `JobRequest`, so a job
is checked the same way wherever it comes from, before anything is written. `job_row()` is
what `ResultStore.create_job` takes; the core itself writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from farm.core.errors import FarmError
from farm.core.search import search_class
from farm.core.targets import TargetSpec, parse_target
from farm.core.task import Task
from farm.core.workloads import Workload, make_workload


def family_key(task: Task) -> str:
    """Tasks whose trials can train one cost model: same template, target kind, workload."""
    return f"{task.template.name}|{task.target.kind}|{task.workload.name}"


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

    @classmethod
    def build(cls, workloads: Sequence[str | Workload | tuple[str, dict[str, Any]]],
              target: str | dict[str, Any] | TargetSpec, trials: int, *, search: str = "xgb", workers: int = 1,
              seed: int = 0, batch_size: int = 16, rpc_keys: Sequence[str] = (), name: str = "") -> JobRequest:
        """Validate everything (raises FarmError with one clear line) and return the request.

        A workload is a Workload, a preset or workload name, or (name, {param: value}).
        """
        wls = [w if isinstance(w, Workload) else make_workload(w) if isinstance(w, str) else make_workload(*w)
               for w in workloads]
        if not wls:
            raise FarmError("a job needs at least one workload")
        spec = parse_target(target)
        for value, what in ((trials, "trials"), (workers, "workers"), (batch_size, "batch size")):
            if not isinstance(value, int) or value < 1:
                raise FarmError(f"{what} must be a positive integer, got {value!r}")
        if trials < len(wls):
            raise FarmError(f"{trials} trials cannot cover {len(wls)} workloads: give at least one each")
        search_class(search)
        request = cls(wls, spec, trials, search, workers, seed, batch_size, list(rpc_keys),
                      name or ("tune " + ", ".join(str(w) for w in wls))[:200])
        for task in request.tasks:
            task.template  # noqa: B018 - raises FarmError when no template exists for the target
        return request

    @property
    def tasks(self) -> list[Task]:
        return [Task(w, self.target) for w in self.workloads]

    def spec(self) -> dict[str, Any]:
        """The job's spec as stored: enough to run it again anywhere."""
        return {"workloads": [w.to_json() for w in self.workloads], "target": self.target.to_json(),
                "trials": self.trials, "search": self.search, "workers": self.workers, "seed": self.seed,
                "batch_size": self.batch_size, "rpc_keys": self.rpc_keys}

    def task_rows(self) -> list[dict[str, Any]]:
        """One row per task, the job's budget split as evenly as possible over them."""
        base, extra = divmod(self.trials, len(self.workloads))
        return [{
            "workload": t.workload.to_json(), "workload_key": t.workload.key,
            "target": t.target.to_json(), "target_kind": t.target.kind,
            "template": t.template.name, "template_version": t.template.version,
            "space_size": t.space.size, "budget": base + (1 if i < extra else 0),
            "family_key": family_key(t),
        } for i, t in enumerate(self.tasks)]

    def job_row(self) -> dict[str, Any]:
        """The keyword arguments of `ResultStore.create_job` that queue this job and its tasks."""
        return {"name": self.name, "spec": self.spec(), "trials_budget": self.trials, "search": self.search,
                "tasks": self.task_rows()}
