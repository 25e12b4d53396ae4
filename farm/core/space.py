"""Config spaces: knobs, exact sizes, index <-> config bijections, JSON, shards.

A `ConfigSpace` is an ordered list of knobs. Its configs are numbered 0..size-1 in mixed
radix with the *first* knob varying fastest (AutoTVM's order), so `space.get(i)` and
`space.index(config)` are inverse bijections. A `Shard` is the subset {i : i mod K == s}:
K shards are disjoint, cover the space, and each one samples every region of it.

Validity constraints (threads per block, shared memory, vthreads) are the template's
`check`; the space itself holds only the knobs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from farm.core.errors import FarmError

KnobValue = Any  # a tuple of ints for a split, a JSON scalar for a choice


def factorizations(extent: int, parts: int) -> list[tuple[int, ...]]:
    """All ordered `parts`-tuples of positive ints whose product is `extent`, lexicographic."""
    if parts == 1:
        return [(extent,)]
    out: list[tuple[int, ...]] = []
    for d in range(1, extent + 1):
        if extent % d == 0:
            out.extend((d, *rest) for rest in factorizations(extent // d, parts - 1))
    return out


class Knob:
    """A named dimension of a config space with a finite, ordered list of values."""

    name: str

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
        except (KeyError, TypeError):
            raise FarmError(f"knob {self.name}: {value!r} is not one of its values") from None

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
        self.name, self.extent, self.parts = name, extent, parts

    @cached_property
    def values(self) -> list[tuple[int, ...]]:
        return factorizations(self.extent, self.parts)

    def normalize(self, value: KnobValue) -> KnobValue:
        return tuple(int(v) for v in value)

    def describe(self) -> str:
        return f"split {self.extent} into {self.parts} factors"


class ChoiceKnob(Knob):
    """One value among a fixed list."""

    def __init__(self, name: str, values: Sequence[KnobValue]) -> None:
        self.name, self._values = name, list(values)

    @property
    def values(self) -> list[KnobValue]:
        return self._values

    def describe(self) -> str:
        return f"one of {self._values}"


@dataclass(frozen=True)
class Config:
    """One point of a space: its index and each knob's value."""

    index: int
    values: tuple[tuple[str, KnobValue], ...]

    def __getitem__(self, name: str) -> KnobValue:
        for k, v in self.values:
            if k == name:
                return v
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.values}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))


class ConfigSpace:
    """The product of `knobs`; configs numbered in mixed radix, first knob fastest."""

    def __init__(self, knobs: Sequence[Knob]) -> None:
        names = [k.name for k in knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate knob names in {names}")
        self.knobs = list(knobs)
        self._by_name = {k.name: k for k in knobs}

    @cached_property
    def size(self) -> int:
        return math.prod(len(k) for k in self.knobs)

    def __len__(self) -> int:
        return self.size

    def knob(self, name: str) -> Knob:
        return self._by_name[name]

    def get(self, index: int) -> Config:
        """The config numbered `index`; raises FarmError outside [0, size)."""
        if not 0 <= index < self.size:
            raise FarmError(f"config index {index} is outside the space [0, {self.size})")
        rest, values = index, []
        for knob in self.knobs:
            rest, i = divmod(rest, len(knob))
            values.append((knob.name, knob.value(i)))
        return Config(index, tuple(values))

    def index(self, values: Mapping[str, KnobValue]) -> int:
        """The index of the config with these knob values (every knob exactly once)."""
        extra = sorted(set(values) - set(self._by_name))
        missing = [k.name for k in self.knobs if k.name not in values]
        if extra or missing:
            raise FarmError(f"config does not fit the space: unknown knobs {extra}, missing {missing}")
        index, radix = 0, 1
        for knob in self.knobs:
            index += knob.index(values[knob.name]) * radix
            radix *= len(knob)
        return index

    def from_json(self, doc: Mapping[str, KnobValue]) -> Config:
        """Validate a JSON config against this space and return it (with its index)."""
        if not isinstance(doc, Mapping):
            raise FarmError(f"a config must be a JSON object of knob values, got {doc!r}")
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
