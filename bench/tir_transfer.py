"""What a cost model learnt on one shape of a TIR kernel tells about another shape of it.

    python bench/tir_transfer.py --source A.db --target B.db [--json FILE]

For each kernel family (the same TVMScript but for its numbers: farm.core.tir.TirWorkload.family)
with trials in both stores, the configs measured on the target shape are ranked three ways, and
each ranking is compared with their measured speed (Spearman of score against throughput, failed
configs slowest):

- `decisions`: the farm's own features of a design-space config (farm.core.design_features: its
  sampling decisions, the tiles' extents, the workload's size), the model trained on the source
  shape's trials with the farm's XGBoost settings (farm.core.costmodel);
- `per_store`: MetaSchedule's `PerStoreFeature` of each config's schedule (replayed here, on the
  CPU), averaged and maxed over its stores, the same model trained on the same trials;
- `own`: the farm's features, trained on half of the target shape's own trials and ranking the
  other half (two folds, averaged): what the shape's own measurements teach, for scale.

The configs of a store tuned with another version of the template are read as long as they fit
the current space (the design spaces are the same for a TVM version and seed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from db.store import open_store
from farm.core.costmodel import CostModel, relative_throughput, spearman
from farm.core.design_features import DesignSpaceFeaturizer
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import workload_from_json


def tasks(path: Path) -> dict[str, tuple[Task, pd.DataFrame]]:
    """{family: (task, its trials)} of the TIR tasks of the store at `path` (the last job's of each)."""
    store = open_store(f"sqlite:///{path}")
    out: dict[str, tuple[Task, pd.DataFrame]] = {}
    for job in store.jobs(limit=100):
        for row in store.job(job["id"])["tasks"]:
            if row["workload"]["name"] != "tir":
                continue
            task = Task(workload_from_json(row["workload"]), parse_target(row["target"]))
            frame = store.trials_for_family(row["family_key"])
            frame = frame[[p.get("hash") == task.workload.hash for p in frame["params"]]]
            out.setdefault(task.workload.family, (task, frame))
    return out


def labelled(task: Task, frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(codes of the trials' configs that fit the task's space, their relative throughput)."""
    codes, fits = DesignSpaceFeaturizer(task).codes_of_configs(list(frame["config"]))
    latency = np.where(frame["status"].to_numpy() == "ok", frame["latency"].to_numpy(dtype=np.float64), np.nan)
    latency = latency[fits]
    return codes, relative_throughput(latency, np.zeros(len(latency), dtype=np.int64))


def per_store(task: Task, codes: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """MetaSchedule's per-store features of each config's schedule, mean and max over its stores."""
    from tvm.s_tir import meta_schedule as ms

    from farm.core.templates.design_space import design_space

    space = design_space(task.workload, task.target)
    feats = DesignSpaceFeaturizer(task)
    extractor = ms.feature_extractor.PerStoreFeature()
    args = ms.arg_info.ArgInfo.from_prim_func(task.workload.prim_func())
    rows = []
    for index in feats.indices(codes):
        sch = task.schedule(task.space.get(int(index)))
        (matrix,) = extractor.extract_from(space._context, [ms.MeasureCandidate(sch, args)])
        values = matrix.numpy()
        rows.append(np.concatenate([values.mean(axis=0), values.max(axis=0)]))
    width = len(rows[0]) // 2
    return np.array(rows, dtype=np.float32), [f"mean{i}" for i in range(width)] + [f"max{i}" for i in range(width)]


def ranked(train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray], names: list[str]) -> float | None:
    """Spearman of a model fitted on `train` (features, labels), scoring `test`'s features."""
    model = CostModel(seed=0).fit(train[0], names, train[1], np.zeros(len(train[1]), dtype=np.int64))
    return spearman(model.predict(test[0], names), test[1])


def compare(source: tuple[Task, pd.DataFrame], target: tuple[Task, pd.DataFrame]) -> dict[str, Any]:
    (task_a, frame_a), (task_b, frame_b) = source, target
    codes_a, labels_a = labelled(task_a, frame_a)
    codes_b, labels_b = labelled(task_b, frame_b)
    feats_a, feats_b = DesignSpaceFeaturizer(task_a), DesignSpaceFeaturizer(task_b)
    names = list(dict.fromkeys(feats_a.names + feats_b.names))

    def aligned(feats: DesignSpaceFeaturizer, codes: np.ndarray) -> np.ndarray:
        out = np.full((len(codes), len(names)), np.nan, dtype=np.float32)
        out[:, [names.index(n) for n in feats.names]] = feats.features(codes)
        return out

    x_a, x_b = aligned(feats_a, codes_a), aligned(feats_b, codes_b)
    half = np.arange(len(labels_b)) % 2 == 0
    own = [ranked((x_b[m], labels_b[m]), (x_b[~m], labels_b[~m]), names) for m in (half, ~half)]
    store_a, store_names = per_store(task_a, codes_a)
    store_b, _ = per_store(task_b, codes_b)
    return {
        "source": str(task_a.workload), "target": str(task_b.workload),
        "source_trials": len(labels_a), "target_trials": len(labels_b),
        "decisions": ranked((x_a, labels_a), (x_b, labels_b), names),
        "per_store": ranked((store_a, labels_a), (store_b, labels_b), store_names),
        "own": float(np.mean([r for r in own if r is not None])) if any(r is not None for r in own) else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="store with the shape the model learns from")
    parser.add_argument("--target", type=Path, required=True, help="store with the shape it ranks")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    source, target = tasks(args.source), tasks(args.target)
    results = []
    for family in sorted(set(source) & set(target)):
        result = compare(source[family], target[family])
        results.append(result)
        print(f"{result['source']} ({result['source_trials']} trials) -> {result['target']} "
              f"({result['target_trials']}): Spearman decisions {result['decisions']}, per-store "
              f"{result['per_store']}, own half {result['own']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
