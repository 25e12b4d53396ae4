"""The shared XGBoost cost model: ranks configs of a task by predicted speed.

One model per family (template@version + target kind + workload name, farm.core.jobspec.family_key), trained on every
measured trial of the family's tasks, whatever their shape: the features (farm.core.features) carry
the shape, and the labels are ranked within a shape only. So a model trained on some shapes
ranks the configs of a shape it never saw (transfer, `farm predict`).

- Objective: XGBoost's ``rank:pairwise`` with queries = workload shapes; the label of a trial
  is its throughput relative to the best of its shape (best latency / latency, in (0, 1]); a
  failed trial (build error, invalid, wrong result, timeout) counts as the slowest (0).
- `CostModel.predict` returns scores, higher = faster; only their order within one shape means
  anything. An untrained model scores everything 0.
- Serialised with XGBoost's own UBJSON (`to_bytes`/`from_bytes`), never pickle, carrying the
  SHA-256 of its bytes as a booster attribute. A stored model that is damaged or not a model is
  reported (`CostModelError`; `load_model` logs a warning and starts a fresh model) before
  XGBoost parses it, so it cannot crash a tuning job.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from farm.core.errors import FarmError
from farm.core.features import featurizer
from farm.core.measure import MeasureResult
from farm.core.task import Task
from farm.core.workloads import workload_from_json

if TYPE_CHECKING:  # imported where used: a third of a second that `farm submit` need not pay
    import pandas as pd

log = logging.getLogger("farm.core.costmodel")

# Chosen on measured llvm samples (bench/costmodel_features.py; docs/defaults.md#cost-model-parameters).
XGB_PARAMS: dict[str, Any] = {
    "objective": "rank:pairwise",
    "lambdarank_pair_method": "mean",
    "eta": 0.15,
    "max_depth": 5,
    "min_child_weight": 1.0,
    "tree_method": "hist",
    "max_bin": 32,
}
BOOST_ROUNDS = 160
# Pairs sampled per trial: a fixed budget of comparisons, so the small sets of the first rounds
# (where the ranking matters most: 64 pairs rank better than 8) get many, and 10,000 trials
# still train in about a second on one core (8 pairs each; pairs dominate the time there).
PAIR_BUDGET, MIN_PAIRS, MAX_PAIRS = 80_000, 8, 128
# Fewer rows than this, or a single label value, teach nothing: the model stays as it was.
MIN_TRAINING_ROWS = 8
# XGBoost's threads, in training and prediction. The farm's models are small (10,000 trials train in
# about a second on one core), and the processes that train and use them (the scheduler, each shard's
# search) share their host with the build processes: a thread more waits, at every level of every
# tree, for a core a build holds (docs/defaults.md#xgboost-threads).
XGB_THREADS = 1


def xgboost_module() -> Any:
    """XGBoost, imported where first used: a third of a second that `farm submit` need not pay."""
    import xgboost

    return xgboost


# The booster attribute holding the SHA-256 (hex) of the model's bytes saved without it, and how
# it appears in XGBoost's UBJSON (keys and strings: 'L' + int64 length + bytes).
DIGEST_ATTR = "farm_sha256"
_DIGEST_ENTRY = (b"L" + struct.pack(">q", len(DIGEST_ATTR)) + DIGEST_ATTR.encode() + b"SL" + struct.pack(">q", 64))


class CostModelError(FarmError):
    """A stored cost model that cannot be used (corrupt bytes, not an XGBoost model)."""


class CostModel:
    """An XGBoost ranking model over named features (see the module docstring).

    Not thread-safe: fit and predict from one thread at a time (the scheduler's loop does).
    """

    def __init__(self, booster: Any = None, feature_names: Sequence[str] = (), seed: int = 0) -> None:
        self.booster = booster
        self.feature_names = list(feature_names)
        self.seed = seed
        self._layout: dict[tuple[str, ...], np.ndarray] = {}
        if booster is not None:
            booster.set_param({"nthread": XGB_THREADS})

    @property
    def trained(self) -> bool:
        return self.booster is not None

    def fit(self, features: np.ndarray, feature_names: Sequence[str], labels: np.ndarray,
            groups: np.ndarray) -> CostModel:
        """Train from scratch on `features` (n, F) with relevance `labels` (n,) in [0, 1].

        `groups` (n,) says which rows are ranked against each other (one id per shape). Returns
        self. With fewer than MIN_TRAINING_ROWS rows or one label value it changes nothing.
        """
        xgb = xgboost_module()
        if len(labels) < MIN_TRAINING_ROWS or np.ptp(labels) == 0:
            return self
        order = np.argsort(groups, kind="stable")  # XGBoost wants each query's rows together
        data = xgb.DMatrix(features[order], label=labels[order], qid=groups[order],
                           feature_names=list(feature_names), nthread=XGB_THREADS)
        params = {**XGB_PARAMS, "seed": self.seed, "nthread": XGB_THREADS}
        if params["objective"].startswith("rank:"):
            params["lambdarank_num_pair_per_sample"] = int(np.clip(PAIR_BUDGET // len(labels), MIN_PAIRS, MAX_PAIRS))
        self.booster = xgb.train(params, data, num_boost_round=BOOST_ROUNDS)
        self.feature_names = list(feature_names)
        self._layout.clear()
        return self

    def predict(self, features: np.ndarray, feature_names: Sequence[str]) -> np.ndarray:
        """Scores (n,) float32, higher = predicted faster; zeros from an untrained model.

        Columns are matched by name: a feature the model never saw is ignored and one it
        expects but `features` lacks is missing (NaN), so a model survives knobs being added.
        """
        if self.booster is None:
            return np.zeros(len(features), dtype=np.float32)
        layout = self._columns(tuple(feature_names))
        aligned = np.full((len(features), len(self.feature_names)), np.nan, dtype=np.float32)
        present = layout >= 0
        aligned[:, present] = features[:, layout[present]]
        return np.asarray(self.booster.inplace_predict(aligned, validate_features=False), dtype=np.float32)

    def _columns(self, names: tuple[str, ...]) -> np.ndarray:
        if names not in self._layout:
            position = {name: i for i, name in enumerate(names)}
            self._layout[names] = np.array([position.get(n, -1) for n in self.feature_names], dtype=np.intp)
        return self._layout[names]

    def to_bytes(self) -> bytes:
        """The booster as XGBoost UBJSON (feature names included); ValueError if untrained.

        The model carries the SHA-256 of its own bytes (saved without it) as the booster attribute
        `DIGEST_ATTR`, so `from_bytes` can tell a damaged model before XGBoost parses it.
        """
        if self.booster is None:
            raise ValueError("an untrained cost model has nothing to save")
        self.booster.set_attr(**{DIGEST_ATTR: None})
        plain = bytes(self.booster.save_raw("ubj"))
        self.booster.set_attr(**{DIGEST_ATTR: hashlib.sha256(plain).hexdigest()})
        try:
            return bytes(self.booster.save_raw("ubj"))
        finally:
            self.booster.set_attr(**{DIGEST_ATTR: None})

    @classmethod
    def from_bytes(cls, data: bytes, seed: int = 0) -> CostModel:
        """Load a model saved by `to_bytes`; CostModelError if `data` is not one or is damaged.

        The digest is checked first: XGBoost's parser crashes the process on some damaged models
        (measured with XGBoost 3.2: cut at arbitrary points, or with one byte overwritten).
        """
        xgb = xgboost_module()
        data = bytes(data)
        at = data.find(_DIGEST_ENTRY)
        if at < 0:
            raise CostModelError("stored cost model is not a readable XGBoost model saved by the farm "
                                 f"(no {DIGEST_ATTR} attribute: damaged, or saved by something else)")
        end = at + len(_DIGEST_ENTRY) + 64
        if hashlib.sha256(data[:at] + data[end:]).hexdigest().encode() != data[at + len(_DIGEST_ENTRY) : end]:
            raise CostModelError("stored cost model is not a readable XGBoost model (damaged: its bytes do not "
                                 "match the digest it was saved with)")
        try:
            booster = xgb.Booster(model_file=bytearray(data))
        except (xgb.core.XGBoostError, ValueError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CostModelError(f"stored cost model is not a readable XGBoost model ({first[:200]})") from None
        booster.set_attr(**{DIGEST_ATTR: None})
        names = booster.feature_names
        if not names:
            raise CostModelError("stored cost model has no feature names: it was not saved by the farm")
        return cls(booster, names, seed)


@dataclass
class StoredModel:
    """A model and its id in the store (None: not stored, e.g. a fresh one)."""

    model: CostModel
    model_id: int | None


class ModelSource(Protocol):
    """Where stored models are read from (db.store.ResultStore is one; the core imports no storage)."""

    def latest_model(self, family_key: str) -> dict[str, Any] | None:
        """The family's newest model row (`id`, `version`, `model` bytes, ...), None if none."""


def load_model(store: ModelSource, family: str) -> StoredModel | None:
    """The family's newest model from `store`, None if it has none.

    A stored model that cannot be read is logged as a warning and replaced by a fresh,
    untrained model (model_id None): tuning goes on, and the next retrain saves a good one.
    """
    row = store.latest_model(family)
    if row is None:
        return None
    try:
        return StoredModel(CostModel.from_bytes(row["model"]), row["id"])
    except CostModelError as e:
        log.warning("cost model %s (version %s of %s): %s; starting from a fresh model",
                    row["id"], row["version"], family, e)
        return StoredModel(CostModel(), None)


# --- labels, training sets, evaluation -------------------------------------------------------


def relative_throughput(latencies: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Labels: best latency of the row's group / the row's latency, in (0, 1]; NaN (failed) -> 0."""
    import pandas as pd

    lat = np.asarray(latencies, dtype=np.float64)
    ok = np.isfinite(lat) & (lat > 0)
    best = pd.Series(np.where(ok, lat, np.inf)).groupby(np.asarray(groups)).transform("min").to_numpy()
    return np.where(ok, best / np.where(ok, lat, 1.0), 0.0)


@dataclass
class TrainingSet:
    """Feature rows of measured trials, ready for `CostModel.fit`."""

    features: np.ndarray
    feature_names: list[str]
    labels: np.ndarray
    groups: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def training_set(trials: pd.DataFrame, task: Task) -> TrainingSet:
    """Features and labels of a family's trials (`ResultStore.trials_for_family`'s frame).

    Every shape (``params``) is featurized with its own space; trials whose config no longer
    fits that space (an older template) are left out. Columns are the union over shapes, a
    feature some shape lacks being NaN (missing, to XGBoost).
    """
    blocks: list[tuple[list[str], np.ndarray, np.ndarray]] = []
    groups: list[np.ndarray] = []
    for number, (key, frame) in enumerate(trials.groupby("workload_key", sort=False)):
        wl = workload_from_json({"name": task.workload.name, "params": frame["params"].iloc[0]})
        feats = featurizer(Task(wl, task.target, task.template.name))
        codes, fits = feats.codes_of_configs(list(frame["config"]))
        if not len(codes):
            log.info("no trial of %s fits its current space; left out of training", key)
            continue
        latency = np.where(frame["status"].to_numpy() == "ok", frame["latency"].to_numpy(dtype=np.float64), np.nan)
        blocks.append((feats.names, feats.features(codes), latency[fits]))
        groups.append(np.full(len(codes), number, dtype=np.int64))
    if not blocks:
        return TrainingSet(np.zeros((0, 0), np.float32), [], np.zeros(0), np.zeros(0, np.int64))
    names = list(dict.fromkeys(name for block_names, _, _ in blocks for name in block_names))
    features = np.vstack([_aligned(values, block_names, names) for block_names, values, _ in blocks])
    group = np.concatenate(groups)
    labels = relative_throughput(np.concatenate([lat for _, _, lat in blocks]), group)
    return TrainingSet(features, names, labels, group)


def _aligned(values: np.ndarray, names: list[str], to: list[str]) -> np.ndarray:
    if names == to:
        return values
    position = {name: i for i, name in enumerate(names)}
    out = np.full((len(values), len(to)), np.nan, dtype=np.float32)
    for j, name in enumerate(to):
        if name in position:
            out[:, j] = values[:, position[name]]
    return out


def spearman(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float | None:
    """Spearman rank correlation (ties averaged); None when either side is constant."""
    import pandas as pd

    x, y = pd.Series(np.asarray(a, dtype=np.float64)), pd.Series(np.asarray(b, dtype=np.float64))
    if len(x) < 2 or x.nunique() < 2 or y.nunique() < 2:
        return None
    return float(x.rank().corr(y.rank()))


def rank_correlation(model: CostModel, task: Task, results: Sequence[MeasureResult]) -> float | None:
    """How well `model` ranked `results` of `task`: Spearman between its scores and the measured
    throughput (failed configs slowest). None if the model is untrained or nothing can be ranked."""
    results = [r for r in results if r.config_index != task.baseline_index]  # no knobs to score
    if not model.trained or not results:
        return None
    feats = featurizer(task)
    codes = feats.codes([r.config_index for r in results])
    scores = model.predict(feats.features(codes), feats.names)
    latency = np.array([r.latency if r.latency is not None else np.nan for r in results], dtype=np.float64)
    return spearman(scores, relative_throughput(latency, np.zeros(len(results), dtype=np.int64)))


def warm_up(task: Task) -> None:
    """What the first `train` for `task` would do before it trains, done ahead: import XGBoost and
    analyse the task's workload (its cached featurizer). The first retraining of a job's task,
    which the model-guided search waits for, took 1.9 to 6.1 s on GPU hosts against 0.3 s for
    the next ones (2 cores here: 0.74 s cold, 0.03 s warm)."""
    xgboost_module()  # imported for its import's cost, paid now
    featurizer(task)


def train(trials: pd.DataFrame, task: Task, seed: int = 0) -> tuple[CostModel, TrainingSet, float]:
    """A fresh model fitted to a family's trials: (model, its training set, seconds taken).

    The model is untrained when the trials teach nothing (see `CostModel.fit`).
    """
    start = time.perf_counter()
    data = training_set(trials, task)
    model = CostModel(seed=seed).fit(data.features, data.feature_names, data.labels, data.groups)
    return model, data, time.perf_counter() - start
