"""Zero-shot configs: the family's cost model picks configs for a shape nobody tuned (`farm predict`).

Like spio's performance model, a prediction takes no tuning: the latest model of the task's
family (same template and version, target kind and workload; farm.core.jobspec.family_key), trained on the shapes
the farm measured, ranks the new shape's configs. The search is `XGBSearch`'s annealing
without random exploration, so the configs returned are valid (the template's check), distinct
and diverse. Optionally they are measured on this machine, as `farm tune` would.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from farm.core.costmodel import ModelSource, load_model
from farm.core.errors import FarmError
from farm.core.host import gpu_count
from farm.core.jobspec import family_key
from farm.core.measure import MeasureResult
from farm.core.search import XGBSearch
from farm.core.targets import TargetSpec
from farm.core.task import Task
from farm.core.workloads import Workload
from workers.device import LocalDevice


@dataclass
class Prediction:
    """One predicted config: its rank (1 = predicted fastest), index, knob values and score.

    `status`, `latency_us` and `error` are filled when it was measured.
    """

    rank: int
    config_index: int
    config: dict[str, Any]
    score: float
    status: str | None = None
    latency_us: float | None = None
    error: str = ""


def predict(workload: Workload, target: TargetSpec, store: ModelSource, top: int = 5, measure: bool = False,
            seed: int = 0, log_dir: Path | None = None) -> list[Prediction]:
    """The family model's `top` best configs for `workload` on `target`, best first.

    `store` holds the family's models (a db.store.ResultStore). With `measure`, each config is also built and measured
    on this machine (a local RPC server; cuda needs a GPU here). Raises FarmError when the
    family has no usable model yet, saying what to tune first.
    """
    if top < 1:
        raise FarmError(f"--top must be at least 1, got {top}")
    task = Task(workload, target)
    family = family_key(task)
    stored = load_model(store, family)
    if stored is None or not stored.model.trained:
        why = "has no cost model yet" if stored is None else "has no readable cost model (see the warning above)"
        kernel = "a kernel of this family (the same TVMScript but for its numbers)" if workload.name == "tir" \
            else f"a {workload.name}"
        example = "KERNEL.py" if workload.name == "tir" else f"{workload.name} ..."
        raise FarmError(f"family {family} {why}: tune {kernel} on {target.kind} first, "
                        f"e.g. `farm tune {example} --target {target.kind} --search xgb`")
    search = XGBSearch(task, task.space.shards(1)[0], seed, epsilon=0.0)
    search.set_model(stored.model)
    indices = search.ranked(top)  # best first; the first does not depend on `top`
    feats = search.features
    scores = stored.model.predict(feats.features(feats.codes(indices)), feats.names)
    out = [Prediction(rank, i, task.space.get(i).to_json(), float(score))
           for rank, (i, score) in enumerate(zip(indices, scores, strict=True), 1)]
    if measure:
        for p, result in zip(out, measure_locally(task, [p.config_index for p in out], log_dir), strict=True):
            p.status, p.error = result.status.value, result.error
            p.latency_us = result.latency * 1e6 if result.latency is not None else None
    return out


def measure_locally(task: Task, indices: list[int], log_dir: Path | None = None) -> list[MeasureResult]:
    """Build and measure configs of `task` on this machine (workers.device.LocalDevice: a tracker,
    one RPC server on the first GPU for cuda, the farm's Worker), torn down afterwards.
    FarmError without a GPU for cuda."""
    if task.target.is_gpu and gpu_count() == 0:
        raise FarmError("no GPU visible here (nvidia-smi lists none) to measure cuda configs: "
                        "leave out --measure, or run on a machine with an NVIDIA GPU")
    with LocalDevice(task.target.kind, "predict", gpu="0", log_dir=log_dir) as device:
        return device.build_and_measure(task, indices)


def render(predictions: list[Prediction], as_json: bool = False) -> str:
    """The predictions as text for the terminal (one line each, knob values as JSON) or JSON."""
    if as_json:
        return json.dumps([asdict(p) for p in predictions], indent=2)
    lines = []
    for p in predictions:
        measured = ""
        if p.status is not None:
            measured = f"  {p.latency_us:.2f} µs" if p.latency_us is not None else f"  {p.status}: {p.error}"
        lines.append(f"#{p.rank} score {p.score:+.3f}{measured}  config {json.dumps(p.config, sort_keys=True)}")
    return "\n".join(lines)
