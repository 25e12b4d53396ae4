"""Config spaces: knobs, exact sizes, index <-> config bijections, JSON, shards.

A `ConfigSpace` is an ordered list of knobs. Its configs are numbered 0..size-1 in mixed
radix with the *first* knob varying fastest (AutoTVM's order), so `space.get(i)` and
`space.index(config)` are inverse bijections. A `Shard` is the subset {i : i mod K == s}:
K shards are disjoint, cover the space, and each one samples every region of it.

Validity constraints (threads per block, shared memory, vthreads) are the template's
`check`; the space itself holds only the knobs.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from farm.core.errors import FarmError, brief

KnobValue = Any  # a tuple of ints for a split, a JSON scalar for a choice

# Bounds on a space, checked when it is built (at submit, from the template) and before anything is
# enumerated. A knob's values are listed in memory, so a split has at most MAX_KNOB_VALUES of them
# (extents up to farm.core.workloads.MAX_EXTENT have at most 125,440 4-way splits). Config
# indices are int64 in the search and the database (BIGINT), so a space has at most MAX_SPACE_SIZE.
MAX_KNOB_VALUES = 200_000
MAX_SPACE_SIZE = 2**62


def prime_factors(n: int) -> dict[int, int]:
    """{prime: exponent} of n >= 1, by trial division (n is at most MAX_EXTENT in practice)."""
    out: dict[int, int] = {}
    d = 2
    while d * d <= n:
        while n % d == 0:
            out[d] = out.get(d, 0) + 1
            n //= d
        d += 1
    if n > 1:
        out[n] = out.get(n, 0) + 1
    return out


def factorization_count(extent: int, parts: int) -> int:
    """How many ordered `parts`-tuples of positive ints multiply to `extent`, without listing them:
    each prime's exponent e is spread over the parts in C(e + parts - 1, parts - 1) ways."""
    return math.prod(math.comb(e + parts - 1, parts - 1) for e in prime_factors(extent).values())


def factorizations(extent: int, parts: int) -> list[tuple[int, ...]]:
    """All ordered `parts`-tuples of positive ints whose product is `extent`, lexicographic.

    Walks the divisors only (never every integer below `extent`), so it takes time in proportion
    to the number of tuples; FarmError if there are more than MAX_KNOB_VALUES of them.
    """
    count = factorization_count(extent, parts)
    if count > MAX_KNOB_VALUES:
        raise FarmError(f"splitting a loop of {extent:,} into {parts} factors has {count:,} ways, "
                        f"more than the farm's bound of {MAX_KNOB_VALUES:,} per knob")
    divisors = [1]
    for prime, exponent in prime_factors(extent).items():
        divisors = [d * prime**k for d in divisors for k in range(exponent + 1)]
    divisors.sort()

    def split(rest: int, left: int) -> list[tuple[int, ...]]:
        if left == 1:
            return [(rest,)]
        return [(d, *tail) for d in divisors if d <= rest and rest % d == 0 for tail in split(rest // d, left - 1)]

    return split(extent, parts)


class Knob:
    """A named dimension of a config space with a finite, ordered list of values."""

    name: str
    # The value a config written without this knob stands for (see ChoiceKnob); None: no such
    # config fits the space.
    default: KnobValue | None = None

    @property
    def values(self) -> Sequence[KnobValue]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.values)

    def value(self, i: int) -> KnobValue:
        return self.values[i]

    def index(self, value: KnobValue) -> int:
        """Position of `value`; raises FarmError when it is not a value of this knob."""
        try:
            return self._positions[self.normalize(value)]
        except (KeyError, TypeError):  # not a value, or not even hashable / of the right type
            raise FarmError(f"knob {self.name}: {brief(value)} is not one of its values") from None

    def normalize(self, value: KnobValue) -> KnobValue:
        return value

    @cached_property
    def _positions(self) -> dict[KnobValue, int]:
        return {v: i for i, v in enumerate(self.values)}

    def describe(self) -> str:
        raise NotImplementedError


class SplitKnob(Knob):
    """Split a loop of `extent` into `parts` factors (outermost first) whose product is exact."""

    def __init__(self, name: str, extent: int, parts: int) -> None:
        """FarmError if the split has more than MAX_KNOB_VALUES values (counted, not listed)."""
        self.name, self.extent, self.parts = name, extent, parts
        self.count = factorization_count(extent, parts)
        if self.count > MAX_KNOB_VALUES:
            raise FarmError(f"knob {name}: splitting a loop of {extent:,} into {parts} factors has {self.count:,} "
                            f"ways, more than the farm's bound of {MAX_KNOB_VALUES:,} per knob")

    def __len__(self) -> int:
        return self.count

    @cached_property
    def values(self) -> list[tuple[int, ...]]:
        return factorizations(self.extent, self.parts)

    def normalize(self, value: KnobValue) -> KnobValue:
        # Integers only: 2.7 is not a factor, nor is True; a list from JSON becomes a tuple.
        if not isinstance(value, list | tuple) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise TypeError("a split is a list of integers")
        return tuple(value)

    def describe(self) -> str:
        return f"split {self.extent} into {self.parts} factors"


class TileKnob(SplitKnob):
    """A split as MetaSchedule samples one (`SamplePerfectTile`, `SamplePartitionedTile`): the
    factorizations of `extent` into `parts` whose innermost factor is at most `max_innermost`
    (None: any) and whose factors from `partition` on multiply to a multiple of `multiple`."""

    def __init__(self, name: str, extent: int, parts: int, max_innermost: int | None = None,
                 partition: int = 0, multiple: int = 1) -> None:
        super().__init__(name, extent, parts)
        self.max_innermost, self.partition, self.multiple = max_innermost, partition, multiple
        self.count = len(self.values)

    @cached_property
    def values(self) -> list[tuple[int, ...]]:
        return [f for f in factorizations(self.extent, self.parts)
                if (self.max_innermost is None or f[-1] <= self.max_innermost)
                and math.prod(f[self.partition:]) % self.multiple == 0]

    def describe(self) -> str:
        bound = f", innermost <= {self.max_innermost}" if self.max_innermost is not None else ""
        multiple = f", parts {self.partition}.. a multiple of {self.multiple}" if self.multiple > 1 else ""
        return f"split {self.extent} into {self.parts} factors{bound}{multiple}"


class ChoiceKnob(Knob):
    """One value among a fixed list.

    `default` is for a knob added to a template after configs of it were exported: the value
    that builds what those configs built, filled in where a config lacks the knob. Added as the
    space's last knob with `default` its first value, it leaves every earlier config's index as
    it was (the last knob varies slowest), so stored trials keep their meaning.
    """

    def __init__(self, name: str, values: Sequence[KnobValue], default: KnobValue | None = None) -> None:
        self.name, self._values = name, list(values)
        if default is not None and default not in self._values:
            raise ValueError(f"knob {name}: default {default!r} is not one of its values")
        self.default = default

    @property
    def values(self) -> list[KnobValue]:
        return self._values

    def normalize(self, value: KnobValue) -> KnobValue:
        # Of the values' own type: True is not 1 and 1.0 is not 1, though Python compares them equal.
        if not any(type(value) is type(v) for v in self._values):
            raise TypeError(f"{type(value).__name__} is not the type of this knob's values")
        return value

    def describe(self) -> str:
        return f"one of {self._values}"


@dataclass(frozen=True)
class Config:
    """One point of a space: its index and each knob's value."""

    index: int
    values: tuple[tuple[str, KnobValue], ...]
    # The values by name: a search's annealing checks hundreds of configs per trial, each reading
    # most of its knobs.
    _by_name: dict[str, KnobValue] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", dict(self.values))

    def __getitem__(self, name: str) -> KnobValue:
        return self._by_name[name]

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.values}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))


class Columns:
    """Many configs of one space as columns: each knob's values as a NumPy array, (n,) for a
    choice and (n, parts) for a split, so that a template's validity rules run on thousands of
    configs at once (`Template.precheck_columns`) and, on one, as its `check`."""

    def __init__(self, values: Mapping[str, np.ndarray], n: int) -> None:
        self._values, self.n = dict(values), n

    @classmethod
    def of_codes(cls, space: ConfigSpace, codes: np.ndarray) -> Columns:
        """The configs given as codes: one value position per knob of `space`, (n, knobs), as the
        search's featurizer has them."""
        return cls({knob.name: table[codes[:, j]] for j, (knob, table) in enumerate(zip(space.knobs, space.tables,
                                                                                       strict=True))}, len(codes))

    @classmethod
    def of_config(cls, config: Config) -> Columns:
        return cls({name: np.array([value]) for name, value in config.values}, 1)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._values[name]

    def __len__(self) -> int:
        return self.n


class ConfigSpace:
    """The product of `knobs`; configs numbered in mixed radix, first knob fastest."""

    def __init__(self, knobs: Sequence[Knob]) -> None:
        """FarmError if the space has more than MAX_SPACE_SIZE configs (nothing is enumerated)."""
        names = [k.name for k in knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate knob names in {names}")
        self.knobs = list(knobs)
        self._by_name = {k.name: k for k in knobs}
        if self.size > MAX_SPACE_SIZE:
            raise FarmError(f"the config space has {self.size:.3e} configs, more than the farm's bound of "
                            f"2^62 (config indices are 64-bit integers)")

    @cached_property
    def size(self) -> int:
        return math.prod(len(k) for k in self.knobs)

    def __len__(self) -> int:
        return self.size

    @cached_property
    def tables(self) -> list[np.ndarray]:
        """Each knob's values as an array indexed by value position (`Columns.of_codes`)."""
        return [np.array(knob.values) for knob in self.knobs]

    def knob(self, name: str) -> Knob:
        return self._by_name[name]

    def get(self, index: int) -> Config:
        """The config numbered `index`; raises FarmError outside [0, size)."""
        if not 0 <= index < self.size:
            raise FarmError(f"config index {index} is outside the space [0, {self.size})")
        rest, values = index, []
        for name, knob_values, count in self._radices:
            rest, i = divmod(rest, count)
            values.append((name, knob_values[i]))
        return Config(index, tuple(values))

    @cached_property
    def _radices(self) -> list[tuple[str, Sequence[KnobValue], int]]:
        """Each knob's name, values and count, first knob first: `get` decodes with these."""
        return [(k.name, k.values, len(k)) for k in self.knobs]

    def index(self, values: Mapping[str, KnobValue]) -> int:
        """The index of the config with these knob values (every knob exactly once, except that a
        knob with a default may be left out)."""
        extra = sorted(str(k) for k in set(values) - set(self._by_name))
        missing = [k.name for k in self.knobs if k.name not in values and k.default is None]
        if extra or missing:
            raise FarmError(f"config does not fit the space: unknown knobs {brief(extra)}, missing {missing}")
        index, radix = 0, 1
        for knob in self.knobs:
            index += knob.index(values.get(knob.name, knob.default)) * radix
            radix *= len(knob)
        return index

    def from_json(self, doc: Mapping[str, KnobValue]) -> Config:
        """Validate a JSON config against this space and return it (with its index); FarmError,
        and no other exception, for anything that is not exactly one of its configs."""
        if not isinstance(doc, Mapping):
            raise FarmError(f"a config must be a JSON object of knob values, got {brief(doc)}")
        return self.get(self.index(doc))

    def shards(self, count: int) -> list[Shard]:
        """`count` disjoint shards that together cover the space (deterministic)."""
        if count < 1:
            raise ValueError("shard count must be >= 1")
        return [Shard(self, s, count) for s in range(count)]

    def describe(self) -> list[dict[str, Any]]:
        return [{"knob": k.name, "size": len(k), "kind": k.describe()} for k in self.knobs]


@dataclass(frozen=True)
class Shard:
    """The configs whose index is congruent to `number` modulo `count`."""

    space: ConfigSpace
    number: int
    count: int

    @property
    def size(self) -> int:
        return max(0, (self.space.size - self.number + self.count - 1) // self.count)

    def index(self, j: int) -> int:
        """The space index of this shard's `j`-th config."""
        return self.number + j * self.count

    def local(self, index: int) -> int:
        """Inverse of `index`: position of a space index within this shard."""
        return (index - self.number) // self.count

    def __contains__(self, index: int) -> bool:
        return 0 <= index < self.space.size and index % self.count == self.number

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.number, self.space.size, self.count))


class UnionSpace(ConfigSpace):
    """The disjoint union of `parts`, each a ConfigSpace: part 0's configs are numbered first, then
    part 1's, and so on. A config names its part with the knob `part_knob`, then gives that part's
    knobs (parts may use the same knob names for different things)."""

    def __init__(self, parts: Sequence[ConfigSpace], part_knob: str) -> None:
        """FarmError if the union has more than MAX_SPACE_SIZE configs."""
        if not parts:
            raise ValueError("a union of no spaces")
        self.parts, self.part_knob = list(parts), part_knob
        self.offsets = [0]
        for part in self.parts:
            self.offsets.append(self.offsets[-1] + part.size)
        self.size = self.offsets[-1]
        if self.size > MAX_SPACE_SIZE:
            raise FarmError(f"the config space has {self.size:.3e} configs, more than the farm's bound of "
                            f"2^62 (config indices are 64-bit integers)")
        # Every knob name once (the first part's knob of a name standing for all): what generic
        # code asks of a space's knobs is whether one of a name exists.
        knobs: dict[str, Knob] = {part_knob: ChoiceKnob(part_knob, list(range(len(self.parts))))}
        for part in self.parts:
            for knob in part.knobs:
                knobs.setdefault(knob.name, knob)
        self.knobs = list(knobs.values())
        self._by_name = knobs

    def part_of(self, index: int) -> int:
        """The part config `index` belongs to."""
        return bisect.bisect_right(self.offsets, index) - 1

    def get(self, index: int) -> Config:
        if not 0 <= index < self.size:
            raise FarmError(f"config index {index} is outside the space [0, {self.size})")
        part = self.part_of(index)
        local = self.parts[part].get(index - self.offsets[part])
        return Config(index, ((self.part_knob, part), *local.values))

    def index(self, values: Mapping[str, KnobValue]) -> int:
        part = values.get(self.part_knob)
        if not isinstance(part, int) or isinstance(part, bool) or not 0 <= part < len(self.parts):
            raise FarmError(f"config does not fit the space: {self.part_knob} must be an integer in "
                            f"[0, {len(self.parts)}), got {brief(part)}")
        rest = {k: v for k, v in values.items() if k != self.part_knob}
        return self.offsets[part] + self.parts[part].index(rest)

    def describe(self) -> list[dict[str, Any]]:
        return [{"knob": f"{self.part_knob} {i}: {k['knob']}", "size": k["size"], "kind": k["kind"]}
                for i, part in enumerate(self.parts) for k in part.describe()]


@lru_cache(maxsize=1024)
def neighbour_table(knob: Knob) -> tuple[np.ndarray, np.ndarray]:
    """(table, degree): row v lists the value positions one move away from value v, padded;
    degree[v] is how many there are. A split's move takes one prime factor from one position to
    another (product kept; a move out of a TileKnob's values is none); a choice may move to any
    other value."""
    if not isinstance(knob, SplitKnob):
        size = len(knob)
        table = np.array([[w for w in range(size) if w != v] for v in range(size)], dtype=np.int64)
        return table.reshape(size, max(size - 1, 0)), np.full(size, size - 1, dtype=np.int64)
    positions = knob._positions
    rows: list[list[int]] = []
    for value in knob.values:
        found: set[int] = set()
        for src, factor in enumerate(value):
            for p in prime_factors(factor):
                for dst in range(knob.parts):
                    if dst != src:
                        moved = list(value)
                        moved[src] //= p
                        moved[dst] *= p
                        if (position := positions.get(tuple(moved))) is not None:
                            found.add(position)
        rows.append(sorted(found))
    width = max(1, max((len(r) for r in rows), default=1))
    table = np.zeros((len(rows), width), dtype=np.int64)
    for v, r in enumerate(rows):
        table[v, : len(r)] = r
    return table, np.array([len(r) for r in rows], dtype=np.int64)
