"""Search strategies: propose the next configs of one shard to measure.

Contract for every strategy:
- `propose(n)` returns up to `n` config indices of its shard, each passing the template's
  pre-build check, none proposed before by this strategy and none in `measured`;
  fewer than `n` (possibly none) only when the shard has no such configs left.
- `observe(results)` feeds back measurements (the model-guided search learns from them).
- Strategies are cheap to construct and are created per shard with a seed, so a run is
  reproducible given its seed.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Iterable

from farm.errors import FarmError
from farm.measure import MeasureResult
from farm.space import Shard
from farm.task import Task

# Random proposals that fail the validity check before a shard counts as exhausted.
_MAX_REJECTS = 20_000


class SearchStrategy(ABC):
    """Proposes configs of one shard of one task (see the module docstring for the contract)."""

    name: str

    def __init__(self, task: Task, shard: Shard, seed: int = 0) -> None:
        self.task, self.shard = task, shard
        self.rng = random.Random(seed * 1_000_003 + shard.number)
        self.seen: set[int] = set()  # proposed or known measured
        self.skipped_invalid = 0

    def mark_measured(self, indices: Iterable[int]) -> None:
        """Exclude configs measured elsewhere (another shard's worker, an earlier run)."""
        self.seen.update(indices)

    @abstractmethod
    def propose(self, n: int) -> list[int]:
        """Up to `n` new valid config indices of the shard."""

    def observe(self, results: list[MeasureResult]) -> None:  # noqa: B027 - optional hook
        """Learn from measured results (no-op for model-free strategies)."""

    def _valid(self, index: int) -> bool:
        if self.task.check(self.task.space.get(index)) is None:
            return True
        self.skipped_invalid += 1
        return False


class RandomSearch(SearchStrategy):
    """Uniform sampling without replacement."""

    name = "random"

    def __init__(self, task: Task, shard: Shard, seed: int = 0) -> None:
        super().__init__(task, shard, seed)
        self._order: list[int] | None = None  # a full permutation, for shards small enough

    def propose(self, n: int) -> list[int]:
        size = self.shard.size
        if size <= 200_000:
            if self._order is None:
                self._order = list(range(size))
                self.rng.shuffle(self._order)
            out = []
            while self._order and len(out) < n:
                index = self.shard.index(self._order.pop())
                if index not in self.seen and self._valid(index):
                    self.seen.add(index)
                    out.append(index)
            return out
        out, rejects = [], 0
        while len(out) < n and rejects < _MAX_REJECTS:
            index = self.shard.index(self.rng.randrange(size))
            if index in self.seen or not self._valid(index):
                rejects += 1
                continue
            self.seen.add(index)
            out.append(index)
        return out


class GridSearch(SearchStrategy):
    """Every config of the shard in index order."""

    name = "grid"

    def __init__(self, task: Task, shard: Shard, seed: int = 0) -> None:
        super().__init__(task, shard, seed)
        self._cursor = 0

    def propose(self, n: int) -> list[int]:
        out = []
        while len(out) < n and self._cursor < self.shard.size:
            index = self.shard.index(self._cursor)
            self._cursor += 1
            if index not in self.seen and self._valid(index):
                self.seen.add(index)
                out.append(index)
        return out


STRATEGIES: dict[str, type[SearchStrategy]] = {s.name: s for s in (RandomSearch, GridSearch)}


def make_search(name: str, task: Task, shard: Shard, seed: int = 0) -> SearchStrategy:
    """The strategy called `name` for one shard; FarmError for an unknown name."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise FarmError(f"unknown search {name!r}; choose one of {', '.join(STRATEGIES)}") from None
    return cls(task, shard, seed)
