"""Features of configs of a MetaSchedule design space (farm.core.templates.design_space) for the
cost model, computed in bulk with NumPy: the same interface as farm.core.features.Featurizer.

A config is a sketch and its sampling decisions, so its features are the decisions themselves,
named so that the same decision of another shape of the same kernel lands in the same column:

- ``wl.flops``, ``wl.bytes``, ``wl.out``: log2 of the workload's FLOPs, compulsory bytes and
  output elements, constant within a task: they let the model tell shapes apart;
- ``sketch``: the sketch's number;
- ``<tileN>.p<i>``: log2 of part i of the tile decision ``tileN``, and ``<tileN>.extent`` log2 of
  the loop it splits;
- ``parts<n>.p<i>``: the sum of ``.p<i>`` over the sketch's n-part tiles. MultiLevelTiling splits
  every spatial loop into as many parts (5 on GPUs: block, virtual thread, thread, two inner
  levels) and every reduction loop into another number (3), so these are log2 of the block's
  threads, of the grid, of each thread's outputs, of a reduction step: what decides a kernel's
  speed whatever its shape;
- ``<choiceN>``, ``<locN>``: the candidate chosen (its value when a number, else its position)
  and the compute location.

Codes, the common currency of search and training, are (sketch, position of each decision),
shape (n, 1 + the most decisions of a sketch), unused positions 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from farm.core.space import ChoiceKnob, Knob, TileKnob, UnionSpace, neighbour_table
from farm.core.task import Task


class DesignSpaceFeaturizer:
    """Feature matrices of one design-space task's configs (see the module docstring).
    Thread-safe after construction (read-only tables)."""

    def __init__(self, task: Task) -> None:
        space = task.space
        assert isinstance(space, UnionSpace)
        self.task, self.space = task, space
        self.parts = [part.knobs for part in space.parts]
        self.width = max(len(knobs) for knobs in self.parts)
        sketches = len(self.parts)
        self.radix = np.ones((sketches, self.width), dtype=np.int64)
        self.stride = np.zeros((sketches, self.width), dtype=np.int64)
        for s, knobs in enumerate(self.parts):
            stride = 1
            for j, knob in enumerate(knobs):
                self.radix[s, j], self.stride[s, j] = len(knob), stride
                stride *= len(knob)
        self.offsets = np.array(space.offsets[:-1], dtype=np.int64)
        self._positions = [[knob._positions for knob in knobs] for knobs in self.parts]

        wl = task.workload
        self._const = np.array([math.log2(max(1, wl.flops())), math.log2(max(1, wl.bytes())),
                                math.log2(max(1, math.prod(wl.output_shape())))], dtype=np.float32)
        names = ["wl.flops", "wl.bytes", "wl.out", "sketch"]
        column: dict[str, int] = {}

        def col(name: str) -> int:
            return column.setdefault(name, len(names) + len(column))

        # Per sketch and decision: (columns, table of values x columns); per sketch: the columns it has.
        self._tables: list[list[tuple[np.ndarray, np.ndarray]]] = []
        self._has: list[np.ndarray] = []
        for knobs in self.parts:
            tables, has = [], set()
            for knob in knobs:
                cols, values = _columns(knob, col)
                tables.append((np.array(cols, dtype=np.intp), values))
                has.update(cols)
            self._tables.append(tables)
            self._has.append(np.array(sorted(has), dtype=np.intp))
        self.names: list[str] = names + sorted(column, key=column.__getitem__)

    # --- configs <-> codes ---------------------------------------------------------------

    def codes(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        sketch = np.searchsorted(self.offsets, idx, side="right") - 1
        local = (idx - self.offsets[sketch]).reshape(-1, 1)
        positions = (local // np.maximum(self.stride[sketch], 1)) % self.radix[sketch]
        positions[self.stride[sketch] == 0] = 0
        return np.concatenate([sketch.reshape(-1, 1), positions], axis=1)

    def indices(self, codes: np.ndarray) -> np.ndarray:
        sketch = codes[:, 0].astype(np.int64)
        return self.offsets[sketch] + (codes[:, 1:].astype(np.int64) * self.stride[sketch]).sum(axis=1)

    def codes_of_configs(self, configs: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """Codes of configs given as knob values (JSON, as stored with trials), and which fit."""
        codes = np.zeros((len(configs), 1 + self.width), dtype=np.int64)
        fits = np.ones(len(configs), dtype=bool)
        for i, config in enumerate(configs):
            sketch = config.get(self.space.part_knob)
            if not isinstance(sketch, int) or not 0 <= sketch < len(self.parts) \
                    or len(config) != 1 + len(self.parts[sketch]):
                fits[i] = False
                continue
            codes[i, 0] = sketch
            for j, (knob, positions) in enumerate(zip(self.parts[sketch], self._positions[sketch], strict=True)):
                value = config.get(knob.name)
                position = positions.get(tuple(value) if isinstance(value, list) else value)
                if position is None:
                    fits[i] = False
                    break
                codes[i, 1 + j] = position
        return codes[fits], fits

    def neighbours(self, codes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Each row with one decision moved to a neighbouring value (`neighbour_table`), or, with
        the chance of one decision among the sketch's, moved to another sketch (each position
        kept where it fits)."""
        moved = codes.copy()
        sketches = len(self.parts)
        for s in range(sketches):
            rows = np.nonzero(codes[:, 0] == s)[0]
            if not len(rows):
                continue
            mutable = [j for j, knob in enumerate(self.parts[s]) if len(knob) > 1]
            choices = len(mutable) + (1 if sketches > 1 else 0)
            if not choices:
                continue
            which = rng.integers(0, choices, size=len(rows))
            for k, j in enumerate(mutable):
                picked = rows[which == k]
                table, degree = neighbour_table(self.parts[s][j])
                current = codes[picked, 1 + j]
                pick = (rng.random(len(picked)) * degree[current]).astype(np.int64)
                moved[picked, 1 + j] = np.where(degree[current] > 0, table[current, pick], current)
            switched = rows[which == len(mutable)]
            if len(switched):
                other = (s + rng.integers(1, sketches, size=len(switched))) % sketches
                positions = codes[switched, 1:] % self.radix[other]
                positions[self.stride[other] == 0] = 0
                moved[switched, 0], moved[switched, 1:] = other, positions
        return moved

    # --- features ------------------------------------------------------------------------

    def features(self, codes: np.ndarray) -> np.ndarray:
        """The feature matrix (n, len(names)), float32, of configs given as codes; a column the
        config's sketch does not have is NaN (missing, to XGBoost)."""
        out = np.full((len(codes), len(self.names)), np.nan, dtype=np.float32)
        out[:, :3] = self._const
        out[:, 3] = codes[:, 0]
        for s, tables in enumerate(self._tables):
            rows = np.nonzero(codes[:, 0] == s)[0]
            if not len(rows):
                continue
            block = np.zeros((len(rows), len(self.names)), dtype=np.float32)
            for j, (cols, table) in enumerate(tables):
                if len(cols):
                    block[:, cols] += table[codes[rows, 1 + j]]
            out[np.ix_(rows, self._has[s])] = block[:, self._has[s]]
        return out


def _columns(knob: Knob, col: Any) -> tuple[list[int], np.ndarray]:
    """The columns a decision adds to and its table (values x columns)."""
    if isinstance(knob, TileKnob):
        logs = np.log2(np.array(knob.values, dtype=np.float64)).reshape(len(knob), knob.parts)
        cols = [col(f"{knob.name}.p{i}") for i in range(knob.parts)]
        cols += [col(f"parts{knob.parts}.p{i}") for i in range(knob.parts)]
        cols.append(col(f"{knob.name}.extent"))
        extent = np.full((len(knob), 1), math.log2(knob.extent))
        return cols, np.concatenate([logs, logs, extent], axis=1).astype(np.float32)
    values = list(knob.values) if isinstance(knob, ChoiceKnob) else []
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    column = np.array(values if numeric else range(len(knob)), dtype=np.float64).reshape(-1, 1)
    return [col(knob.name)], column.astype(np.float32)
