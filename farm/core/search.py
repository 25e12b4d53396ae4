"""Search strategies: propose the next configs of one shard to measure.

Contract for every strategy:
- `propose(n)` returns up to `n` config indices of its shard, each passing the template's
  pre-build check, none proposed before by this strategy and none in `measured`;
  fewer than `n` (possibly none) only when the shard has no such configs left.
- `observe(results)` feeds back measurements (the model-guided search learns from them).
- Strategies are cheap to construct and are created per shard with a seed, so a run is
  reproducible given its seed.
- `set_model(model)` hands a strategy the cost model retrained after each round (farm.core.costmodel);
  every strategy takes it, model-free ones ignore it.
- `origin(index)` says which part of the strategy proposed a config it returned (`ORIGINS`); the
  tuning loop stores it with the config's trial, so a run shows what found its best.

A job names its search by a spec: a strategy's name, optionally with options of that strategy
(`OPTIONS`), as `name:key=value,key=value` (`xgb:screen=16,epsilon=0.25`). `parse_search` is the
one check of specs; the job stores the spec as given, so a run's settings stay with its trials.
"""

from __future__ import annotations

import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from farm.core.errors import FarmError
from farm.core.features import featurizer
from farm.core.measure import MeasureResult
from farm.core.space import Config, KnobValue, Shard
from farm.core.task import Task

if TYPE_CHECKING:
    from farm.core.costmodel import CostModel

# Random proposals that fail the validity check before a shard counts as exhausted.
_MAX_REJECTS = 20_000
# Checking the best-scored candidates of a plan stops once the plan is full and this long was spent:
# a design space's check replays the config (about 10 ms), and most of a GPU design space's configs
# are invalid, so filling the diversity pool (8 plans' worth) could take a minute.
PLAN_CHECK_SECONDS = 1.0
# Knob values that make a candidate compile quickly, which the model-guided search keeps to until
# it has a model: those first proposals are unguided (nothing yet says an unrolled config will be
# faster), and the devices wait for their builds. Unrolling is what makes a build slow, and every
# template that unrolls names its knob so (templates.base.annotate_unroll); the build times behind
# it: docs/defaults.md#quick-first. The first model's proposals range over every value again.
QUICK_BUILD: dict[str, KnobValue] = {"auto_unroll_max_step": 0}
# How many of a shard's first unguided configs keep to QUICK_BUILD: a worker's first batch at the
# default batch size, the single-candidate chunks that make the first trial quick
# (scheduler.tuner). Only those: when every unguided config kept to quick builds, the model-guided
# search started behind random search, since the fastest configs unroll (docs/defaults.md#quick-first).
QUICK_FIRST = 16
# The longest search spec: a job stores it in a 32-character column (db.models.Job.search).
MAX_SEARCH_CHARS = 32
# What may propose a config (`SearchStrategy.origin`, stored with each trial): a uniform draw, the
# grid's order, the model-guided search's screened exploration, or its plan (the model's best);
# or, before any of them, the task's baseline (`SearchStrategy.baseline`).
ORIGINS = ("random", "grid", "explore", "plan", "baseline")


@dataclass(frozen=True)
class SearchOption:
    """One option of a search strategy, as a spec sets it (`xgb:epsilon=0.25`): the one source of
    its type, bounds, default and description, from which `parse_search` checks specs and
    `search_help` and `options_markdown` (`farm tune --help`, docs/search.md) describe it. `why`:
    the anchor of docs/defaults.md that gives the figures behind the default, if any."""

    kind: type[int] | type[float]
    least: float
    most: float
    default: int | float
    help: str
    why: str = ""

    def bounds(self) -> str:
        """The range it accepts, as the docs write it ("0 to 1")."""
        if self.kind is int:
            return f"{int(self.least)} to {int(self.most)}"
        return f"{self.least:g} to {self.most:g}"


class SearchStrategy(ABC):
    """Proposes configs of one shard of one task (see the module docstring for the contract)."""

    name: str
    # Whether its proposals follow the cost model: the tuning loop then waits for a first model
    # before it proposes beyond a round of unguided configs (scheduler.tuner).
    guided = False
    # The keyword arguments of its constructor a search spec may set, by name.
    OPTIONS: ClassVar[dict[str, SearchOption]] = {}

    def __init__(self, task: Task, shard: Shard, seed: int = 0) -> None:
        self.task, self.shard = task, shard
        self.rng = random.Random(seed * 1_000_003 + shard.number)
        self.seen: set[int] = set()  # proposed or known measured
        self.skipped_invalid = 0

    @classmethod
    def settings(cls, options: Mapping[str, int | float]) -> dict[str, int | float]:
        """Every option's value: those of `options`, the others' defaults (TypeError for a name not
        in OPTIONS, as for any unexpected keyword argument)."""
        unknown = sorted(set(options) - set(cls.OPTIONS))
        if unknown:
            raise TypeError(f"{cls.__name__} got unexpected options {unknown}; its options: {list(cls.OPTIONS)}")
        return {name: options.get(name, option.default) for name, option in cls.OPTIONS.items()}

    def baseline(self) -> list[int]:
        """The task's baseline (`Task.baseline_index`: TVM's own schedule of the kernel) the first
        time shard 0 is asked, unless it was measured before; [] otherwise. The tuning loop
        proposes it before the strategy's own configs (scheduler.shards.proposal), so every task's
        first candidate is the schedule its model's build would otherwise get."""
        index = self.task.baseline_index
        if self.shard.number != 0 or index in self.seen:
            return []
        self.seen.add(index)
        return [index]

    def mark_measured(self, measured: Mapping[int, float | None]) -> None:
        """Configs measured before this search began (another shard's worker, an earlier run or
        slice of the task), each with its latency (None: it failed): never proposed."""
        self.seen.update(measured)

    @abstractmethod
    def propose(self, n: int) -> list[int]:
        """Up to `n` new valid config indices of the shard."""

    def origin(self, index: int) -> str:
        """Which part of this strategy proposed `index`, one of `ORIGINS` (a model-free strategy:
        its own name). Only for indices `propose` returned."""
        return self.name

    def observe(self, results: list[MeasureResult]) -> None:  # noqa: B027 - optional hook
        """Learn from measured results (no-op for model-free strategies)."""

    def set_model(self, model: CostModel | None) -> None:  # noqa: B027 - optional hook
        """Use the cost model retrained after a round (no-op for model-free strategies)."""

    def _valid(self, index: int) -> bool:
        if self.task.valid(self.task.space.get(index)):
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
        return self._draw(n)

    def _draw(self, n: int, keep: Callable[[Config], bool] | None = None) -> list[int]:
        """Up to `n` new valid configs in this search's random order; with `keep`, only those it
        accepts, the others left to be drawn later (the next draws without `keep` take them first)."""
        size = self.shard.size
        if size <= 200_000:
            if self._order is None:
                self._order = list(range(size))
                self.rng.shuffle(self._order)
            out, refused = [], []
            while self._order and len(out) < n:
                position = self._order.pop()
                index = self.shard.index(position)
                if index in self.seen:
                    continue
                if keep is not None and not keep(self.task.space.get(index)):
                    refused.append(position)
                elif self._valid(index):
                    self.seen.add(index)
                    out.append(index)
            self._order += reversed(refused)
            return out
        out, rejects = [], 0
        while len(out) < n and rejects < _MAX_REJECTS:
            index = self.shard.index(self.rng.randrange(size))
            if index in self.seen or (keep is not None and not keep(self.task.space.get(index))) \
                    or not self._valid(index):
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


class XGBSearch(RandomSearch):
    """Simulated annealing on the cost model's score, with exploration screened by the model.

    Until `set_model` gives it a trained model it is RandomSearch with the same seed, its first
    `quick_first` configs kept to those that compile quickly (`QUICK_BUILD`) while the shard has
    any: the configs of RandomSearch's order that have those values, in that order; then
    RandomSearch's order over every value. With a model, it
    plans batches (again whenever a new model arrives or the plan is used up):

    - `chains` annealing chains start from the best configs this shard has measured (a fifth
      of them, as MetaSchedule's evolutionary search seeds its population) and from random
      configs of the shard; each of `steps` steps changes one knob of every chain (a
      split moves one prime factor from one position to another, keeping the product; a
      choice takes another value), moves it back into the shard if it left it, and accepts
      the move by the Metropolis rule at a temperature falling to 0. Moves onto configs that
      fail the template's check are refused. A shard no larger than what the chains would
      score is scored whole instead.
    - From the best-scored configs, never any in `seen` and only valid ones, the plan is picked
      greedily by score minus a distance penalty: one standard deviation of the scores for
      every already picked config it differs from in fewer than `min_distance` knobs.

    Every batch takes a share `epsilon` of its configs from screened exploration, the rest from the
    plan: each exploratory config is the best-scored of `screen` configs drawn uniformly from the
    shard's unseen valid ones. Trained on a run's first trials, the model ranks the run's own best
    above every uniform config, so the plan alone stays in the region it found first; yet its
    favourites among uniform draws hold most of the fast configs other runs found
    (docs/defaults.md#epsilon, docs/defaults.md#screen).

    With `late` N > 0, exploration takes `late_eps` of each batch instead, once the shard has N
    results: the plan's yield of fast configs grows as a run goes on while exploration's stays low
    (docs/defaults.md#late, docs/defaults.md#late-eps).

    With `refresh` N > 0 the tuning loop also retrains the model between round closes, whenever N
    results have come in since the last training began, and hands it over, kept in memory only
    (scheduler.tuner), so that a proposal's model is about the queue's length old, not the queue's
    plus up to a round's. 0, the default, retrains at round closes only: the gain stayed within the
    measure's noise (docs/defaults.md#refresh).

    Its options, with their types, bounds and defaults: `OPTIONS` (docs/search.md#search-options).
    """

    name = "xgb"
    guided = True
    OPTIONS: ClassVar[dict[str, SearchOption]] = {
        "epsilon": SearchOption(float, 0.0, 1.0, 0.5, "the share of each batch taken from screened exploration",
                                "epsilon"),
        "screen": SearchOption(int, 1, 1024, 32, "each exploratory config is the model's favourite of this many "
                               "uniform draws (1: uniform picks)", "screen"),
        "chains": SearchOption(int, 1, 4096, 256, "annealing chains, started from the shard's best measured "
                               "configs (a fifth of them) and random ones"),
        "steps": SearchOption(int, 1, 1024, 64, "annealing steps of each chain, each changing one knob"),
        "min_distance": SearchOption(int, 0, 64, 2, "the plan's diversity: a config is penalised for every "
                                     "config already picked that it differs from in fewer knobs than this"),
        "plan_size": SearchOption(int, 1, 1024, 32, "configs planned at a time (planned again when a new model "
                                  "arrives or the plan is used up)"),
        "quick_first": SearchOption(int, 0, 1024, QUICK_FIRST, "a shard's first unguided configs kept to those "
                                    "that build quickly (no unrolling)", "quick-first"),
        "refresh": SearchOption(int, 0, 1024, 0, "N > 0 also retrains the model between round closes, whenever "
                                "N results have come in, kept in memory (`farm tune -v` logs how often); "
                                "0: at round closes only", "refresh"),
        "late": SearchOption(int, 0, 1 << 20, 43, "once the shard has this many results, exploration takes "
                             "`late_eps` of each batch instead of `epsilon` (0: `epsilon` throughout)", "late"),
        "late_eps": SearchOption(float, 0.0, 1.0, 0.15, "exploration's share once the shard has `late` "
                                 "results", "late-eps"),
    }

    def __init__(self, task: Task, shard: Shard, seed: int = 0, **options: int | float) -> None:
        """`options`: any of OPTIONS by name, each its default when not given."""
        super().__init__(task, shard, seed)
        o = self.settings(options)  # `refresh` is the tuning loop's, read from the spec (scheduler.tuner)
        self._seed = seed
        self.epsilon, self.screen = o["epsilon"], int(o["screen"])
        self.chains, self.steps = int(o["chains"]), int(o["steps"])
        self.min_distance, self.plan_size = int(o["min_distance"]), int(o["plan_size"])
        self.late, self.late_eps = int(o["late"]), o["late_eps"]
        self.model: CostModel | None = None
        self._np = np.random.default_rng([seed, shard.number, shard.count])
        self._plan: list[int] = []
        self._measured: dict[int, float] = {}  # this shard's results: index -> latency (inf if failed)
        self._validity: dict[int, bool] = {}
        # `precheck`'s answers: the annealing revisits a config many times (a third of its checks
        # at 1,000 trials), and each check decodes the config first.
        self._prechecked: dict[int, bool] = {}
        space = task.space
        quick = {name: value for name, value in QUICK_BUILD.items()
                 if any(k.name == name and value in k.values for k in space.knobs)}
        # Whether a config has the quick-building values (None: the space has none of those knobs).
        self._quick: Callable[[Config], bool] | None = (
            (lambda config: all(config[name] == value for name, value in quick.items())) if quick else None)
        self._quick_left = int(o["quick_first"])  # unguided configs still to keep to QUICK_BUILD
        self._origins: dict[int, str] = {}  # "explore" or "plan" per config proposed with a model

    @property
    def features(self) -> Any:  # a Featurizer, or a DesignSpaceFeaturizer
        return featurizer(self.task)

    def set_model(self, model: CostModel | None) -> None:
        """Use `model` from now on (None or untrained: random search); drops the current plan."""
        self.model = model if model is not None and model.trained else None
        self._plan = []

    def observe(self, results: list[MeasureResult]) -> None:
        for r in results:
            self.seen.add(r.config_index)
            if r.config_index in self.shard:  # not the baseline, which no knobs describe
                self._measured[r.config_index] = r.latency if r.latency is not None else math.inf

    def mark_measured(self, measured: Mapping[int, float | None]) -> None:
        """Also remembered as if observed, where of this shard: a search started again for a task
        measured before (a model job's next slice of it, once its search was dropped; a job resumed)
        anchors its chains on the shard's best configs and explores as `late` says, as the search
        that measured them did."""
        super().mark_measured(measured)
        for index, latency in measured.items():
            if index in self.shard:
                self._measured[index] = latency if latency is not None else math.inf

    def origin(self, index: int) -> str:
        return self._origins.get(index, "random")

    def propose(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if self.model is None:
            out = self._draw(min(n, self._quick_left), self._quick) if self._quick else []
            self._quick_left -= len(out)
            if len(out) < n:  # past the first configs, or the shard has no quick-building ones left
                self._quick = None
                out += self._draw(n - len(out))
            return out
        explore = int(self._np.binomial(n, self.share()))
        out = self._explore(explore) if explore else []
        while len(out) < n:
            self._plan = [i for i in self._plan if i not in self.seen]
            if not self._plan:
                self._plan = self._make_plan(max(self.plan_size, n - len(out)))
                if not self._plan:  # nothing unseen and valid was found: fall back to random
                    out += super().propose(n - len(out))
                    break
            take, self._plan = self._plan[: n - len(out)], self._plan[n - len(out):]
            self.seen.update(take)
            self._origins.update(dict.fromkeys(take, "plan"))
            out += take
        return out

    def share(self) -> float:
        """The share of the next batch that exploration takes: `epsilon`, or `late_eps` once the
        shard has `late` results (`late` 0: never)."""
        return self.late_eps if self.late and len(self._measured) >= self.late else self.epsilon

    def _explore(self, n: int) -> list[int]:
        """`n` exploratory configs: each the best-scored valid one of `screen` unseen configs of the
        shard drawn uniformly among those passing the template's cheap `precheck` (with `screen`
        1, uniform picks); a group's configs are checked in full best-first, so a costly check
        (a design space's replay) runs about once per group. Those not picked stay unseen. Uniform
        picks make up what the draws cannot (a shard nearly measured, or few valid configs)."""
        out: list[int] = []
        if self.screen > 1:
            pool: list[int] = []
            drawn: set[int] = set()
            for _ in range(_MAX_REJECTS // 256):  # chunks of draws, until the pool is full
                fresh: list[int] = []
                for position in self._np.integers(0, self.shard.size, size=256).tolist():
                    index = self.shard.index(position)
                    if index not in self.seen and index not in drawn:
                        drawn.add(index)
                        fresh.append(index)
                pool += self._passing_precheck(fresh)
                if len(pool) >= n * self.screen:
                    break
            groups = min(n, len(pool) // self.screen)
            if groups:
                pool = pool[: groups * self.screen]
                scores = self._score(self.features.codes(np.array(pool, dtype=np.int64))).reshape(groups, self.screen)
                for g in range(groups):
                    for member in np.argsort(-scores[g], kind="stable").tolist():
                        if self._is_valid(pool[g * self.screen + member]):
                            out.append(pool[g * self.screen + member])
                            break
                self.seen.update(out)
        if len(out) < n:
            out += super().propose(n - len(out))
        self._origins.update(dict.fromkeys(out, "explore"))
        return out

    # --- planning ------------------------------------------------------------------------

    def _make_plan(self, size: int) -> list[int]:
        """Up to `size` diverse, valid, unseen configs of the shard, best predicted first."""
        indices, scores = self._candidates()
        order = np.argsort(-scores, kind="stable")
        # The annealing visited moves it refused too: refused here all at once where the template
        # can, before any is checked in full.
        passes = self._precheck_mask(indices[order])
        candidates = zip(indices[order].tolist(), scores[order].tolist(),
                         passes.tolist() if passes is not None else [True] * len(order), strict=True)
        pool: list[int] = []
        pool_scores: list[float] = []
        deadline = time.monotonic() + PLAN_CHECK_SECONDS
        for i, score, passed in candidates:
            if passed and i not in self.seen and self._is_valid(i):
                pool.append(i)
                pool_scores.append(score)  # each config's own score: invalid or seen ones were skipped
                if len(pool) >= 8 * size or (len(pool) >= size and time.monotonic() > deadline):
                    break
        return self._pick_diverse(pool, np.array(pool_scores, dtype=np.float64), size, float(np.std(scores)))

    def ranked(self, n: int) -> list[int]:
        """The model's `n` best valid configs of the shard, best first, without exploration and
        without changing what `propose` returns next (`farm predict`).

        The candidates are found the same way whatever `n` (annealing from this search's seed),
        and the first is the best-scored valid one among them, so the first answer does not
        depend on `n`. Random configs when the search has no model.
        """
        if self.model is None:
            return RandomSearch(self.task, self.shard, self._seed).propose(n)
        state = self._np.bit_generator.state
        try:
            plan = self._make_plan(max(self.plan_size, n))[:n]
        finally:
            self._np.bit_generator.state = state
        feats = self.features
        scores = self._score(feats.codes(plan)) if plan else np.zeros(0)
        return [plan[k] for k in np.argsort(-scores, kind="stable")]

    def _candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """Distinct configs of the shard with their scores: the whole shard if small, else the
        configs the annealing chains visited."""
        feats = self.features
        assert self.model is not None
        if self.shard.size <= self.chains * (self.steps + 1):
            indices = np.arange(self.shard.number, self.task.space.size, self.shard.count, dtype=np.int64)
            return indices, self._score(feats.codes(indices))
        codes = self._starts()
        scores = self._score(codes)
        # A copy: `scores` follows the chains (updated in place below), the visited list must
        # keep each config's own score.
        visited, visited_scores = [feats.indices(codes)], [scores.copy()]
        temperature = float(np.std(scores)) or 1.0
        for step in range(self.steps):
            moved = self._neighbours(codes)
            moved_scores = self._score(moved)
            moved_indices = feats.indices(moved)
            visited.append(moved_indices)
            visited_scores.append(moved_scores)
            t = temperature * (1.0 - step / self.steps)
            gain = moved_scores - scores
            accept = (gain >= 0) | (self._np.random(len(codes)) < np.exp(np.minimum(gain, 0) / max(t, 1e-9)))
            # The template's cheap necessary condition: a full check of every step of every chain
            # would cost seconds where it replays the config (design spaces). All the moves at
            # once where the template can, else the accepted ones one by one.
            passes = self.task.precheck_codes(moved)
            if passes is not None:
                accept &= passes
            else:
                for row in np.nonzero(accept)[0].tolist():
                    if not self._passes_precheck(int(moved_indices[row])):
                        accept[row] = False
            codes[accept], scores[accept] = moved[accept], moved_scores[accept]
        indices = np.concatenate(visited)
        all_scores = np.concatenate(visited_scores)
        unique, first = np.unique(indices, return_index=True)
        return unique, all_scores[first]

    def _starts(self) -> np.ndarray:
        """Codes of the chains' starting points: the shard's best measured configs (up to a fifth of
        the chains: more anchors the search on the first good region found), the rest uniformly
        random configs of the shard."""
        best = sorted((lat, i) for i, lat in self._measured.items() if math.isfinite(lat))
        seeds = [i for _, i in best[: self.chains // 5]]
        random_count = self.chains - len(seeds)
        local = self._np.integers(0, self.shard.size, size=random_count)
        indices = np.concatenate([np.array(seeds, dtype=np.int64), self.shard.number + local * self.shard.count])
        return self.features.codes(indices)

    def _neighbours(self, codes: np.ndarray) -> np.ndarray:
        """Each row moved one step (`Featurizer.neighbours`), then moved back into the shard."""
        feats = self.features
        moved = feats.neighbours(codes, self._np)
        if self.shard.count == 1:
            return moved
        indices = feats.indices(moved)
        indices -= (indices - self.shard.number) % self.shard.count
        indices[indices < 0] += self.shard.count
        return feats.codes(indices)

    def _score(self, codes: np.ndarray) -> np.ndarray:
        assert self.model is not None
        feats = self.features
        return self.model.predict(feats.features(codes), feats.names).astype(np.float64)

    def _precheck_mask(self, indices: np.ndarray) -> np.ndarray | None:
        """Which of `indices` pass the template's precheck, all at once; None where the template
        prechecks one config at a time (`Task.precheck_codes`)."""
        if not self.task.prechecks_codes or not len(indices):
            return None
        return self.task.precheck_codes(self.features.codes(indices))

    def _passing_precheck(self, indices: list[int]) -> list[int]:
        """Those of `indices` that pass the template's precheck, in order: all at once where the
        template can (`Task.precheck_codes`), else one by one."""
        passes = self._precheck_mask(np.array(indices, dtype=np.int64))
        if passes is None:
            return [i for i in indices if self._passes_precheck(i)]
        return [i for i, passed in zip(indices, passes.tolist(), strict=True) if passed]

    def _passes_precheck(self, index: int) -> bool:
        passes = self._prechecked.get(index)
        if passes is None:
            passes = self._prechecked[index] = self.task.precheck(self.task.space.get(index)) is None
        return passes

    def _is_valid(self, index: int) -> bool:
        if index not in self._validity:
            self._validity[index] = self.task.check(self.task.space.get(index)) is None
        return self._validity[index]

    def _pick_diverse(self, pool: list[int], scores: np.ndarray, size: int, spread: float) -> list[int]:
        """Up to `size` configs of `pool`, picked greedily by score minus a penalty of `spread` (the
        scores' standard deviation) for each picked config it differs from in fewer than
        `min_distance` knobs: a near-duplicate goes in only if it is predicted much better than
        every more distinct config left."""
        if len(pool) <= 1:
            return pool[:size]
        codes = self.features.codes(pool)
        penalty = np.zeros(len(pool))
        picked: list[int] = []
        for _ in range(min(size, len(pool))):
            adjusted = scores - penalty
            adjusted[picked] = -np.inf
            k = int(np.argmax(adjusted))
            picked.append(k)
            penalty += spread * ((codes != codes[k]).sum(axis=1) < self.min_distance)
        return [pool[k] for k in picked]


STRATEGIES: dict[str, type[SearchStrategy]] = {s.name: s for s in (RandomSearch, GridSearch, XGBSearch)}


def parse_search(spec: str) -> tuple[type[SearchStrategy], dict[str, int | float]]:
    """The strategy and options a search spec names (`xgb`, `xgb:screen=16,epsilon=0.25`; see the
    module docstring). FarmError for anything else: an unknown strategy or option, an option given
    twice, a value not of its type or out of its range, a spec over MAX_SEARCH_CHARS."""
    if not isinstance(spec, str):
        raise FarmError(f"a search is a string such as 'xgb', got {type(spec).__name__}")
    if len(spec) > MAX_SEARCH_CHARS:
        raise FarmError(f"a search spec is at most {MAX_SEARCH_CHARS} characters, got {len(spec)}: {spec!r}")
    name, _, given = spec.partition(":")
    strategy = STRATEGIES.get(name)
    if strategy is None:
        raise FarmError(f"unknown search {name!r}; choose one of {', '.join(STRATEGIES)}")
    known = ", ".join(strategy.OPTIONS) or "none"
    options: dict[str, int | float] = {}
    for item in given.split(",") if given else []:
        key, eq, text = item.partition("=")
        if key not in strategy.OPTIONS:
            raise FarmError(f"unknown option {key!r} of search {name!r} (in {spec!r}); its options: {known}")
        if not eq or key in options:
            raise FarmError(f"search {spec!r}: give each option once, as {key}=VALUE")
        option = strategy.OPTIONS[key]
        try:
            value = option.kind(text)
        except ValueError:
            raise FarmError(f"search {spec!r}: {key} takes {'an integer' if option.kind is int else 'a number'}, "
                            f"got {text!r}") from None
        if not option.least <= value <= option.most:  # also refuses nan
            raise FarmError(f"search {spec!r}: {key} must lie in [{option.least:g}, {option.most:g}], got {text}")
        options[key] = value
    return strategy, options


def make_search(spec: str, task: Task, shard: Shard, seed: int = 0) -> SearchStrategy:
    """The strategy a search spec names, with its options, for one shard; FarmError for a bad spec."""
    strategy, options = parse_search(spec)
    return strategy(task, shard, seed, **options)


def _summary(strategy: type[SearchStrategy]) -> str:
    """The first line of a strategy's docstring as a phrase: lower case first, no full stop."""
    line = (strategy.__doc__ or "").strip().splitlines()[0].rstrip(".")
    return line[:1].lower() + line[1:]


def search_help() -> str:
    """The help of `farm tune --search`: the strategies, and each option with its type, bounds,
    default and description (from STRATEGIES and their OPTIONS)."""
    strategies = "; ".join(f"{name} ({_summary(s)})" for name, s in STRATEGIES.items())
    options = [f"{name}:KEY=VALUE,... (at most {MAX_SEARCH_CHARS} characters) takes "
               + "; ".join(f"{key} ({o.kind.__name__}, {o.bounds()}, default {o.default:g}): {o.help}"
                           for key, o in s.OPTIONS.items())
               for name, s in STRATEGIES.items() if s.OPTIONS]
    return f"Search strategy: {strategies}. " + ". ".join(options) + "."


def options_markdown() -> str:
    """The table of every strategy's options in docs/search.md (tests/test_search_options.py keeps
    that page's copy equal to this)."""
    lines = ["| search | option | type | range | default | what it sets |", "|---|---|---|---|---|---|"]
    for name, strategy in STRATEGIES.items():
        for key, o in strategy.OPTIONS.items():
            why = f" ([why](defaults.md#{o.why}))" if o.why else ""
            lines.append(f"| `{name}` | `{key}` | {o.kind.__name__} | {o.bounds()} | {o.default:g} | {o.help}{why} |")
    return "\n".join(lines) + "\n"
