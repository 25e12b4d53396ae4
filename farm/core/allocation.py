"""Where a model job's next trials go: the task whose next slice of trials is expected to lower the
model's latency (Σ weight x best latency over its tasks) the most.

The anchor is Ansor's gradient task scheduler (also MetaSchedule's "gradient"): each task is
visited once (its warm-up slice), then the next slice goes to the task of the steepest expected
descent of the model's latency per trial,

    w_i * (ALPHA * backward_i + (1 - ALPHA) * forward_i)

- backward: how much the task's best latency fell per trial over its last WINDOW trials;
- forward: how much it may still fall, the larger of two guesses: its latency shrinking per trial as
  over its trials so far (g / t), and the gap to the latency it would have at 1/BETA of the best
  throughput (FLOP/s) of its family's tasks in this job (a task far behind its siblings has the most
  to gain).

A task whose space is exhausted gets nothing more; one with no correct trial yet after its warm-up
is weighed by the model's worst task latency (it must find one), but after FAILING_SLICES slices
without one it gets nothing more either: its configs fail (or its kernel cannot be checked), and
more of the same would only take the budget from the kernels that run; `farm build-model` leaves it
to TVM's default schedule and says so. With probability EPSILON a slice
goes to a task at random among those that can take one, so that no estimate starves a task forever.
Tasks with a budget the user fixed, and tasks reused from earlier jobs, are outside the allocation.

Pure logic: the scheduler (scheduler.tuner) tells it each slice's outcome and asks for the next. It may
ask while slices are out (the scheduler overlaps them): their trials are not handed out twice, and a
task with a slice out gets no other until that one's outcome is known.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

ALPHA = 0.2
BETA = 2.0
EPSILON = 0.05
WINDOW = 32  # trials over which the backward gradient is taken
FAILING_SLICES = 2  # slices a task with no correct trial gets at most (module docstring)


@dataclass
class TaskState:
    """One task as the allocation sees it."""

    weight: int
    flops: int
    family: str
    trials: int = 0
    best: float | None = None  # seconds
    exhausted: bool = False
    history: list[tuple[int, float]] = field(default_factory=list)  # (trials, best) after each slice


class GradientAllocation:
    """Slices of a job's budget to its tasks (module docstring). `states` are the tasks the
    allocation may give trials to, in the order their warm-up slices go out; a warm-up slice is
    `warmup_trials` (default: `slice_trials`), every later slice `slice_trials`."""

    def __init__(self, states: list[TaskState], budget: int, slice_trials: int, seed: int = 0,
                 warmup_trials: int | None = None) -> None:
        self.states = states
        self.left = budget  # trials not yet measured
        self.slice = max(1, slice_trials)
        self.warmup = max(1, warmup_trials or slice_trials)
        self.out: dict[int, int] = {}  # task index -> trials of its slice out (handed out, outcome unknown)
        self._rng = random.Random(seed)

    def next(self) -> tuple[int, int] | None:
        """(task index, trials) of the next slice, or None when the budget or every space is spent, or
        every task that may take one has a slice out."""
        open_ = [i for i, s in enumerate(self.states) if i not in self.out and not s.exhausted
                 and (s.best is not None or s.trials < FAILING_SLICES * self.slice)]
        left = self.left - sum(self.out.values())
        if left <= 0 or not open_:
            return None
        cold = [i for i in open_ if self.states[i].trials == 0]
        if cold:
            index = cold[0]
        elif self._rng.random() < EPSILON:
            index = self._rng.choice(open_)
        else:
            index = max(open_, key=lambda i: (self.gradient(i), -i))
        self.out[index] = min(self.warmup if cold else self.slice, left)
        return index, self.out[index]

    def reuse(self, index: int, best: float) -> None:
        """Task `index` takes an earlier job's record (`best` seconds): it needs no trial of this job."""
        self.out.pop(index, None)
        state = self.states[index]
        state.best, state.exhausted = best, True
        state.history.append((state.trials, best))

    def observe(self, index: int, trials: int, best: float | None, exhausted: bool) -> None:
        """A slice given to task `index` ended: it has `trials` now (those it measured in the slice
        come off the budget), `best` its fastest (seconds, None if none ran correctly), `exhausted`
        whether its space is spent."""
        self.out.pop(index, None)
        state = self.states[index]
        self.left -= trials - state.trials
        state.trials, state.best, state.exhausted = trials, best, exhausted
        if best is not None:
            state.history.append((trials, best))

    def gradient(self, index: int) -> float:
        """The task's expected reduction of the model's latency per trial, in weighted seconds."""
        state = self.states[index]
        if state.best is None:
            known = [s.best * s.weight for s in self.states if s.best is not None]
            return max(known, default=1.0)
        best, trials = state.best, max(1, state.trials)
        earlier = [b for t, b in state.history if t <= trials - WINDOW]
        backward = (earlier[-1] - best) / WINDOW if earlier else best / trials
        siblings = [s.flops / s.best for s in self.states if s.family == state.family and s.best and s.flops]
        gap = best - BETA * state.flops / max(siblings) if siblings else 0.0
        forward = max(best / trials, gap)
        return state.weight * (ALPHA * backward + (1 - ALPHA) * forward)


@dataclass(frozen=True)
class KernelShare:
    """One kernel of a model job as `model_latency` sums it."""

    name: str
    weight: int
    best: float | None  # seconds: its fastest correct trial over its tasks (one per template)
    trials: int
    reused: bool  # its record came from an earlier job


def model_kernels(tasks: list[dict[str, Any]]) -> list[KernelShare]:
    """The kernels of a model job's status document (ResultStore.job's tasks): tasks of one kernel
    (tuned with several templates) together, in the job's order."""
    kernels: dict[str, KernelShare] = {}
    for task in tasks:
        key = task["workload_key"]
        best = task["best_latency"]
        known = kernels.get(key)
        if known is not None:
            fastest = min((b for b in (known.best, best) if b is not None), default=None)
            kernels[key] = KernelShare(known.name, known.weight, fastest, known.trials + task["trials"],
                                       known.reused and task.get("reused", False))
        else:
            name = task["workload"].get("params", {}).get("func", task["workload"]["name"])
            kernels[key] = KernelShare(name, int(task.get("weight", 1)), best, task["trials"],
                                       bool(task.get("reused", False)))
    return list(kernels.values())


def model_latency(kernels: list[KernelShare]) -> float | None:
    """The model's estimated latency: Σ weight x best latency of its kernels (seconds); None until
    every kernel has a correct trial. Launch gaps and the kernels left out are not in it."""
    if any(k.best is None for k in kernels):
        return None
    return sum(k.weight * k.best for k in kernels if k.best is not None)
