"""Features of (workload, template, config) for the cost model, computed in bulk with NumPy.

A `Featurizer` is built once per task (it analyses the workload's TE definition, a few ms) and
then turns config indices, or the knob values stored with trials, into a float32 matrix whose
columns have stable names, so one model serves every shape of a family (same template and
target kind; `farm.core.costmodel.family_key`). Columns by prefix:

- ``wl.*``: the workload's parameters (log2(1 + value); a choice by its position), log2 of its
  FLOPs and compulsory bytes; ``axis.*``: log2 of the compute stage's loop extents. Constant
  within a task: they let the model transfer what it learnt to shapes it never measured.
- ``knob.*``: every knob's value: log2 of each factor of a split (``knob.tile_f.2``), a choice's
  value (its position when it is not a number).
- ``split.<spatial|reduce>.<role>``: log2 of the product of one position of the splits over the
  spatial (or reduction) axes, named by what the position means in the template
  (`SPLIT_ROLES`): for cuda.tiled ``split.spatial.threads`` is log2 threads per block,
  ``split.spatial.vthreads`` the vthreads, ``split.spatial.blocks`` the grid size, and
  ``split.spatial.per_thread`` the outputs each thread computes.
- ``tile.<level>.<axis>`` and ``fp.<level>.*``: the tile of each loop and its memory footprint at
  two levels. ``outer``: every factor but the outermost (cuda.tiled: the block's output tile
  and one outer reduction step, i.e. what it stages in shared memory); ``inner``: the innermost
  factor (a thread's register tile on cuda, the register-blocked tile on CPUs). The footprint of
  each input (``fp.outer.in0``, elements), of all inputs (``fp.outer.bytes``), the output tile
  (``fp.outer.out``) and the arithmetic intensity (``fp.outer.intensity``, FLOP per byte) come
  from the compute stage's index expressions, so they hold for every workload. All log2.

Knobs named ``tile_<axis>`` split the compute stage's loop ``<axis>`` (the templates' convention);
an axis without such a knob counts as whole outside the tile (spatial) or whole inside it
(reduction). Everything but the footprints is a sum of per-knob table lookups, which is what
makes 100,000 configs take milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from farm.core.space import ChoiceKnob, Knob, SplitKnob, UnionSpace, neighbour_table
from farm.core.task import Task
from farm.core.workloads import Workload

if TYPE_CHECKING:
    from farm.core.design_features import DesignSpaceFeaturizer

# What each position of a split means, outermost first, per template and kind of axis. Only names:
# a template missing here (or a split of another length) gets positional names (``p0of3``...).
SPLIT_ROLES: dict[str, dict[str, tuple[str, ...]]] = {
    "cuda.tiled": {"spatial": ("blocks", "vthreads", "threads", "inner"), "reduce": ("outer", "middle", "inner")},
    "cuda.depthwise": {"spatial": ("blocks", "threads", "inner"), "reduce": ("outer", "inner")},
    "llvm.tiled": {"spatial": ("outer", "inner"), "reduce": ("outer", "inner")},
    # Its splits count 16x16x16 fragments, not elements: its tiles and footprints are those in
    # elements divided by a constant (16 per axis), which a tree model learns alike.
    "cuda.tensorcore": {"spatial": ("blocks", "warps", "fragments"), "reduce": ("outer", "fragments")},
}
LEVELS = ("outer", "inner")


@dataclass(frozen=True)
class _Axis:
    name: str
    extent: int
    reduce: bool


@dataclass(frozen=True)
class _Dim:
    """One dimension of one input access: |coefficient| per axis, a cap on its span, its extent."""

    coefs: tuple[tuple[str, float], ...] | None  # None: not affine, the whole dimension is read
    cap: float
    extent: int


class Featurizer:
    """Feature matrices of one task's configs (see the module docstring for the columns).

    Thread-safe after construction (read-only tables). `codes` are the configs as one value
    position per knob, shape (n, knobs), the common currency of search and training.
    """

    def __init__(self, task: Task) -> None:
        self.task = task
        self.knobs: list[Knob] = list(task.space.knobs)
        self.radix = np.array([len(k) for k in self.knobs], dtype=np.int64)
        self.stride = np.concatenate([[1], np.cumprod(self.radix)[:-1]]).astype(np.int64)
        self._positions = [{v: i for i, v in enumerate(k.values)} for k in self.knobs]
        wl = task.scheduled_as  # what the template schedules: a TIR kernel's operator (farm.core.fused)
        axes, accesses, self._dtype_bytes = _analyse(wl)
        self._axes, self._accesses = axes, accesses

        names: list[str] = []
        const: list[float] = []
        for key, value in _workload_values(wl).items():
            names.append(f"wl.{key}")
            const.append(value)
        for axis in axes:
            names.append(f"axis.{axis.name}")
            const.append(math.log2(axis.extent))
        self._n_const = len(names)
        self._const = np.array(const, dtype=np.float32)

        # Additive columns: each knob adds table[code] to some of them.
        column: dict[str, int] = {}

        def col(name: str) -> int:
            if name not in column:
                column[name] = len(column)
            return column[name]

        split_axes = {k.name: self._axis_of(k) for k in self.knobs}
        for level in LEVELS:  # unsplit axes: their constant tile
            for axis in axes:
                col(f"tile.{level}.{axis.name}")
        roles = SPLIT_ROLES.get(task.template.name, {})
        contributions: list[list[tuple[int, np.ndarray]]] = []
        for knob in self.knobs:
            parts: list[tuple[int, np.ndarray]] = []
            axis = split_axes[knob.name]
            if isinstance(knob, SplitKnob):
                logs = np.log2(np.array(knob.values, dtype=np.float64))  # (values, parts)
                for i in range(knob.parts):
                    parts.append((col(f"knob.{knob.name}.{i}"), logs[:, i]))
                if axis is not None:
                    kind = "reduce" if axis.reduce else "spatial"
                    names_of = roles.get(kind)
                    if names_of is None or len(names_of) != knob.parts:
                        names_of = tuple(f"p{i}of{knob.parts}" for i in range(knob.parts))
                    for i, role in enumerate(names_of):
                        parts.append((col(f"split.{kind}.{role}"), logs[:, i]))
                    parts.append((col(f"tile.outer.{axis.name}"), logs[:, 1:].sum(axis=1) - self._unsplit(axis)))
                    parts.append((col(f"tile.inner.{axis.name}"), logs[:, -1] - self._unsplit(axis)))
                    if kind == "spatial" and "threads" in names_of:
                        # Outputs per thread: the block's tile over its threads.
                        per_thread = logs[:, 1:].sum(axis=1) - logs[:, names_of.index("threads")]
                        parts.append((col("split.spatial.per_thread"), per_thread))
            else:
                parts.append((col(f"knob.{knob.name}"), _choice_values(knob)))
            contributions.append(parts)
        self._n_add = len(column)
        self._tables = [
            (np.array([c for c, _ in parts], dtype=np.intp),
             np.stack([t for _, t in parts], axis=1).astype(np.float32) if parts else np.zeros((len(k), 0), np.float32))
            for k, parts in zip(self.knobs, contributions, strict=True)
        ]
        self._base = np.zeros(self._n_add, dtype=np.float32)
        for level in LEVELS:
            for axis in axes:
                self._base[column[f"tile.{level}.{axis.name}"]] = self._unsplit(axis)
        self._tile_cols = {
            (level, axis.name): column[f"tile.{level}.{axis.name}"] for level in LEVELS for axis in axes
        }
        add_names = sorted(column, key=column.__getitem__)
        fp_names = [
            f"fp.{level}.{what}"
            for level in LEVELS
            for what in [*(f"in{j}" for j in range(len(accesses))), "bytes", "out", "intensity"]
        ]
        self.names: list[str] = names + add_names + fp_names

    # --- configs <-> codes ---------------------------------------------------------------

    def codes(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Value position of every knob, (n, knobs) int64, for config indices of the space."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1, 1)
        return (idx // self.stride) % self.radix

    def indices(self, codes: np.ndarray) -> np.ndarray:
        """Inverse of `codes`: the config indices, int64."""
        return (codes.astype(np.int64) * self.stride).sum(axis=1)

    def codes_of_configs(self, configs: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """Codes of configs given as knob values (JSON, as stored with trials).

        Returns (codes of the configs that fit the space, boolean mask of which ones did): a
        config from an older version of the template may not fit, and is left out.
        """
        codes = np.zeros((len(configs), len(self.knobs)), dtype=np.int64)
        fits = np.ones(len(configs), dtype=bool)
        for j, (knob, positions) in enumerate(zip(self.knobs, self._positions, strict=True)):
            for i, config in enumerate(configs):
                value = config.get(knob.name) if fits[i] else None
                position = positions.get(tuple(value) if isinstance(value, list) else value)  # JSON: lists
                if position is None:
                    fits[i] = False
                else:
                    codes[i, j] = position
        return codes[fits], fits

    def neighbours(self, codes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Each row with one knob moved to a neighbouring value (`farm.core.space.neighbour_table`)."""
        mutable = [j for j, k in enumerate(self.knobs) if len(k) > 1]
        moved = codes.copy()
        if not mutable:
            return moved
        which = rng.choice(mutable, size=len(codes))
        for j in mutable:
            rows = np.nonzero(which == j)[0]
            table, degree = neighbour_table(self.knobs[j])
            current = codes[rows, j]
            pick = (rng.random(len(rows)) * degree[current]).astype(np.int64)
            moved[rows, j] = np.where(degree[current] > 0, table[current, pick], current)
        return moved

    # --- features ------------------------------------------------------------------------

    def features(self, codes: np.ndarray) -> np.ndarray:
        """The feature matrix (n, len(names)), float32, of configs given as codes."""
        n = len(codes)
        additive = np.broadcast_to(self._base, (n, self._n_add)).copy()
        for j, (columns, table) in enumerate(self._tables):
            if len(columns):
                additive[:, columns] += table[codes[:, j]]
        out = np.empty((n, len(self.names)), dtype=np.float32)
        out[:, : self._n_const] = self._const
        out[:, self._n_const : self._n_const + self._n_add] = additive
        out[:, self._n_const + self._n_add :] = self._footprints(additive)
        return out

    def _footprints(self, additive: np.ndarray) -> np.ndarray:
        cols = []
        for level in LEVELS:
            tile = {a.name: additive[:, self._tile_cols[(level, a.name)]].astype(np.float64) for a in self._axes}
            elements = []
            for dims in self._accesses:
                log_elements = np.zeros(len(additive))
                for dim in dims:
                    log_elements += np.log2(_span(dim, tile))
                elements.append(log_elements)
            read = np.log2(sum(np.exp2(e) for e in elements)) + math.log2(self._dtype_bytes)
            out_tile = sum((tile[a.name] for a in self._axes if not a.reduce), np.zeros(len(additive)))
            flops = 1.0 + sum((tile[a.name] for a in self._axes), np.zeros(len(additive)))
            cols.extend([*elements, read, out_tile, flops - read])
        return np.stack(cols, axis=1)

    def _axis_of(self, knob: Knob) -> _Axis | None:
        if isinstance(knob, SplitKnob) and knob.name.startswith("tile_"):
            return next((a for a in self._axes if a.name == knob.name[len("tile_"):]), None)
        return None

    @staticmethod
    def _unsplit(axis: _Axis) -> float:
        """log2 tile of an axis no knob splits: whole inside the tile if it reduces, else 1."""
        return math.log2(axis.extent) if axis.reduce else 0.0


def _span(dim: _Dim, tile: dict[str, np.ndarray]) -> np.ndarray:
    """Elements of one dimension an access touches over the tile (tile extents given as log2)."""
    if dim.coefs is None:
        return np.full(len(next(iter(tile.values()))), float(dim.extent))
    span = np.ones(len(next(iter(tile.values()))))
    for axis, coef in dim.coefs:
        span += abs(coef) * (np.exp2(tile[axis]) - 1.0)
    return np.minimum(span, min(dim.cap, dim.extent))


@lru_cache(maxsize=256)
def featurizer(task: Task) -> Featurizer | DesignSpaceFeaturizer:
    """The (cached) featurizer of `task`: building one analyses the workload's TE definition. A
    MetaSchedule design space (a union of sketches) has its own (farm.core.design_features)."""
    if isinstance(task.space, UnionSpace):
        from farm.core.design_features import DesignSpaceFeaturizer

        return DesignSpaceFeaturizer(task)
    return Featurizer(task)


def _choice_values(knob: Knob) -> np.ndarray:
    values = list(knob.values) if isinstance(knob, ChoiceKnob) else []
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return np.array(values, dtype=np.float64)
    return np.arange(len(knob), dtype=np.float64)


def _workload_values(wl: Workload) -> dict[str, float]:
    """The workload's parameters as numbers: log2(1 + int), a choice's position."""
    out: dict[str, float] = {}
    for param in wl.definition.params:
        value = wl.p[param.name]
        out[param.name] = float(param.choices.index(value)) if param.choices else math.log2(1 + value)
    out["flops"] = math.log2(max(1, wl.flops()))
    out["bytes"] = math.log2(max(1, wl.bytes()))
    return out


def _analyse(wl: Workload) -> tuple[list[_Axis], list[list[_Dim]], int]:
    """The compute stage's loops, how each input load indexes them, and the dtype's bytes."""
    stages: dict[str, Any] = {}
    pending = list(wl.build_te())
    while pending:
        tensor = pending.pop()
        if tensor.op.name not in stages:
            stages[tensor.op.name] = tensor
            pending.extend(tensor.op.input_tensors)
    op = stages["compute"].op
    axes = [_Axis(iv.var.name, int(iv.dom.extent), False) for iv in op.axis]
    axes += [_Axis(iv.var.name, int(iv.dom.extent), True) for iv in op.reduce_axis]
    loads: list[Any] = []
    _collect_loads(op.body[0], loads)
    accesses = []
    for load in loads:
        tensor, indices = load.args[0], list(load.args[1:])
        dims = []
        for index, extent in zip(indices, tensor.shape, strict=True):
            linear = _linear(index)
            coefs = None if linear is None else tuple(sorted(linear[0].items()))
            dims.append(_Dim(coefs, math.inf if linear is None else linear[1], int(extent)))
        accesses.append(dims)
    return axes, accesses, np.dtype(wl.dtype).itemsize


def _collect_loads(expr: Any, out: list[Any]) -> None:
    """Every tensor read (``te.tensor_load`` call) in a TE expression, in order."""
    import tvm

    if isinstance(expr, tvm.ir.expr.Call) and getattr(expr.op, "name", "") == "te.tensor_load":
        out.append(expr)
        return
    for attr in ("source", "a", "b", "value", "args", "condition", "true_value", "false_value"):
        child = getattr(expr, attr, None)
        if child is None or isinstance(child, str):
            continue
        if isinstance(child, tvm.ir.expr.Expr):
            _collect_loads(child, out)
        elif hasattr(child, "__iter__"):
            for item in child:
                if isinstance(item, tvm.ir.expr.Expr):
                    _collect_loads(item, out)


def _linear(expr: Any) -> tuple[dict[str, float], float] | None:
    """An index as {loop: coefficient} plus a cap on its span, or None if it is not affine.

    Division by a constant scales (floor(f / 8) spans about an eighth of f's tile), a modulo
    caps the span at its divisor.
    """
    from tvm import tirx

    if isinstance(expr, tirx.Var):
        return {expr.name: 1.0}, math.inf
    if isinstance(expr, tirx.IntImm):
        return {}, math.inf
    if isinstance(expr, tirx.Add | tirx.Sub):
        a, b = _linear(expr.a), _linear(expr.b)
        if a is None or b is None:
            return None
        sign = -1.0 if isinstance(expr, tirx.Sub) else 1.0
        coefs = dict(a[0])
        for name, c in b[0].items():
            coefs[name] = coefs.get(name, 0.0) + sign * c
        return coefs, a[1] + b[1]
    if isinstance(expr, tirx.Mul) and isinstance(expr.a, tirx.IntImm):
        expr = tirx.Mul(expr.b, expr.a)  # constant on the right, as below
    if isinstance(expr, tirx.Mul | tirx.FloorDiv | tirx.Div | tirx.FloorMod | tirx.Mod):
        if not isinstance(expr.b, tirx.IntImm) or int(expr.b.value) == 0:
            return None
        inner = _linear(expr.a)
        if inner is None:
            return None
        k = float(expr.b.value)
        if isinstance(expr, tirx.FloorMod | tirx.Mod):
            return inner[0], min(inner[1], k)
        scale = k if isinstance(expr, tirx.Mul) else 1.0 / k
        return {name: c * scale for name, c in inner[0].items()}, inner[1] * scale
    return None
