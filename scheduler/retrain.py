"""Retraining the shared cost model when a round closes, and the model a task starts from.

The scheduler's tuning loop (scheduler.tuner) calls, per task:

- `starting_model(store, row)` before the first round: the family's latest model (so a new
  shape of a template and target kind tuned before is model-guided from its first batch),
- `retrain(store, row, task, current, results)` at each round close, after the round's
  results are flushed to the store and before the round is recorded; the model it returns
  guides the next round (`XGBSearch.set_model`) and is `current` at the next round close.
- `refreshed(store, row, task)` between round closes, for a search that asks for it
  (XGBSearch's `refresh`): a model trained the same way, handed to the searches and not saved.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from db.store import ResultStore
from farm.core.costmodel import CostModel, StoredModel, TrainingSet, load_model, rank_correlation, train
from farm.core.measure import MeasureResult
from farm.core.task import Task

log = logging.getLogger("farm.scheduler")

# Newest trials of a family trained on: bounds retraining time (about 1 s per 10,000 trials
# on 2 cores) however long a family has been tuned.
MAX_TRAINING_TRIALS = 20_000


@dataclass
class Retrained:
    """What `retrain` did.

    `current`: the model to guide the next round (the previous one, unchanged, when the family's
    trials teach nothing yet). `rank_corr`: how well the previous model ranked the round just
    finished (None without a previous trained model), to record with that round.
    """

    current: StoredModel
    rank_corr: float | None
    training_rows: int
    training_seconds: float


def starting_model(store: ResultStore, row: dict[str, Any]) -> StoredModel | None:
    """The latest model of the task's family (`row` is a dict of store.tasks), None if none.

    A corrupt stored model is logged and replaced by a fresh one (see farm.core.costmodel.load_model).
    """
    return load_model(store, row["family_key"])


def retrain(store: ResultStore, row: dict[str, Any], task: Task, previous: StoredModel | None,
            results: Sequence[MeasureResult], max_trials: int = MAX_TRAINING_TRIALS) -> Retrained:
    """Score the model that guided the round on its `results`, retrain on the family, save.

    (a) `previous`'s Spearman rank correlation on `results` is stored with it
        (`store.set_model_rank_corr`) and returned, for the round's record.
    (b) A fresh model is trained on the newest `max_trials` trials of every task of the family
        (this task's included; `store.trials_for_family`), all shapes together.
    (c) It is saved (`store.save_model`, XGBoost UBJSON, with its training rows and seconds) and
        returned with its id. When the trials teach nothing (fewer than 8, or no two throughputs
        differ) nothing is saved and the previous model is returned.

    `row` is the task's dict from `store.tasks`, `task` its Task.
    """
    rank_corr = None
    if previous is not None:
        rank_corr = rank_correlation(previous.model, task, results)
        if rank_corr is not None and previous.model_id is not None:
            store.set_model_rank_corr(previous.model_id, rank_corr)
    model, data, seconds = _family_model(store, row, task, max_trials)
    if not model.trained:
        log.info("task %s: %d trials teach the cost model nothing yet", row["id"], len(data))
        return Retrained(previous or StoredModel(CostModel(), None), rank_corr, 0, seconds)
    model_id = store.save_model(row["family_key"], row["id"], model.to_bytes(), model.feature_names,
                                len(data), seconds)
    log.info("task %s: cost model %d trained on %d trials in %.2f s (previous model's rank correlation %s)",
             row["id"], model_id, len(data), seconds, "n/a" if rank_corr is None else f"{rank_corr:.2f}")
    return Retrained(StoredModel(model, model_id), rank_corr, len(data), seconds)


def refreshed(store: ResultStore, row: dict[str, Any], task: Task,
              max_trials: int = MAX_TRAINING_TRIALS) -> StoredModel | None:
    """A model trained on the family's trials as `retrain` trains one, kept in memory only (model_id
    None: no row in the store, so a job saves one model per round however often it refreshes);
    None when the trials teach nothing yet."""
    model, data, seconds = _family_model(store, row, task, max_trials)
    if not model.trained:
        return None
    log.debug("task %s: cost model refreshed on %d trials in %.2f s", row["id"], len(data), seconds)
    return StoredModel(model, None)


def _family_model(store: ResultStore, row: dict[str, Any], task: Task,
                  max_trials: int) -> tuple[CostModel, TrainingSet, float]:
    """A fresh model trained on the newest `max_trials` trials of the task's family, all shapes
    (`farm.core.costmodel.train`'s model, training set and seconds)."""
    return train(store.trials_for_family(row["family_key"], limit=max_trials), task)
