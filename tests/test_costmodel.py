"""Cost model: features, the XGBoost ranking model, storage without pickle, retraining, prediction.

Trials here have synthetic latencies (a fixed function of the config, below) so the tests are
fast and exact; tests/test_search_xgb.py compares searches on real llvm measurements.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from db.store import ResultStore, open_store
from farm.core.costmodel import (
    XGB_THREADS,
    CostModel,
    CostModelError,
    load_model,
    rank_correlation,
    spearman,
    train,
)
from farm.core.errors import FarmError
from farm.core.features import featurizer
from farm.core.jobspec import JobRequest, family_key
from farm.core.measure import MeasureResult, Status
from farm.core.space import Columns
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.templates.cuda_tiled import _shared_bytes
from farm.core.workloads import make_workload
from farm.predict import predict, render
from farm.report import MAX_LINES, Curve, draw_panel, plot_tuning_curves, rounds_summary, tuning_curves
from scheduler.retrain import retrain, starting_model

CONV = dict(N=1, CI=32, H=14, W=14, CO=32, KH=3, KW=3, pad=1)


def synthetic_latency(task: Task, indices: np.ndarray) -> np.ndarray:
    """Seconds: the FLOPs at 1 GFLOP/s, slower the further the register tile is from 16
    outputs, faster unrolled. The same optimum for every shape, so a model can transfer."""
    feats = featurizer(task)
    x = feats.features(feats.codes(indices))
    inner = x[:, feats.names.index("fp.inner.out")]
    unrolled = x[:, feats.names.index("knob.auto_unroll_max_step")] > 0
    return task.workload.flops() / 1e9 * (1 + (inner - 4.0) ** 2 / 4) * (1.5 - 0.5 * unrolled)


def results_of(task: Task, indices: np.ndarray, round_: int = 0) -> list[MeasureResult]:
    """MeasureResults with synthetic latencies; every 10th config failed (wrong result)."""
    out = []
    for i, latency in zip(indices.tolist(), synthetic_latency(task, indices).tolist(), strict=True):
        failed = i % 10 == 0
        out.append(MeasureResult(i, task.space.get(i).to_json(), Status.WRONG_RESULT if failed else Status.OK,
                                 latencies=[] if failed else [latency], round=round_))
    return out


def add_task(store: ResultStore, workload: str, params: dict[str, Any],
             target: str = "llvm") -> tuple[dict[str, Any], Task]:
    job = store.submit(JobRequest.build([(workload, params)], target, 1000, search="xgb"))
    row = store.tasks(job)[0]
    return row, Task.from_json(row)


def write(store: ResultStore, task_id: int, results: list[MeasureResult]) -> None:
    with store.writer() as writer:
        for r in results:
            writer.record(task_id, r)


def sample(task: Task, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).choice(task.space.size, n, replace=False)


# --- features ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("workload", "target"), [
    ("resnet-last-conv", "cuda"), ("seed-depthwise", "cuda"), ("seed-maxpool", "cuda"), ("spio-grouped", "cuda"),
    ("resnet-last-conv", "llvm"), ("seed-avgpool", "llvm"),
])
def test_features_are_named_finite_and_fast(workload: str, target: str) -> None:
    task = Task(make_workload(workload), parse_target(target))
    feats = featurizer(task)
    assert len(set(feats.names)) == len(feats.names)
    indices = np.random.default_rng(0).integers(0, task.space.size, 100_000)
    start = time.perf_counter()
    x = feats.features(feats.codes(indices))
    seconds = time.perf_counter() - start
    assert x.shape == (100_000, len(feats.names)) and x.dtype == np.float32
    assert np.isfinite(x).all()
    assert seconds < 1.0, f"features of 100,000 configs took {seconds:.2f} s"


def test_codes_round_trip_through_indices_and_stored_configs() -> None:
    task = Task(make_workload("resnet-last-conv"), parse_target("cuda"))
    feats = featurizer(task)
    indices = sample(task, 500, 1)
    codes = feats.codes(indices)
    assert (feats.indices(codes) == indices).all()
    configs = [task.space.get(int(i)).to_json() for i in indices]
    configs.append({**configs[0], "tile_f": [3, 1, 1, 1]})  # not a value of the knob
    from_configs, fits = feats.codes_of_configs(configs)
    assert fits.tolist() == [True] * 500 + [False]
    assert (from_configs == codes).all()


@pytest.mark.parametrize("workload", ["resnet-last-conv", "matmul"])
def test_derived_features_agree_with_the_cuda_template(workload: str) -> None:
    """Threads, vthreads and the shared-memory footprint, derived generically from the knobs and
    the TE index expressions, equal what cuda.tiled computes for its own validity check (the
    footprint is the data's: without the padding of a k-major A tile's rows, which is layout)."""
    params = {} if workload == "resnet-last-conv" else dict(M=512, N=256, K=128)
    task = Task(make_workload(workload, params), parse_target("cuda"))
    feats = featurizer(task)
    indices = sample(task, 300, 2)
    x = feats.features(feats.codes(indices))
    spatial = [k.name for k in task.space.knobs if k.name[5:] in ("n", "f", "y", "x", "i", "j")]
    for row, i in zip(x, indices.tolist(), strict=True):
        config = task.space.get(i)
        value = dict(zip(feats.names, row.tolist(), strict=True))
        assert 2 ** value["split.spatial.threads"] == pytest.approx(np.prod([config[k][2] for k in spatial]))
        assert 2 ** value["split.spatial.vthreads"] == pytest.approx(np.prod([config[k][1] for k in spatial]))
        unpadded = task.space.from_json({**config.to_json(), "a_kmajor": 0})
        assert 2 ** value["fp.outer.bytes"] == pytest.approx(
            _shared_bytes(task.workload, Columns.of_config(unpadded))[0], rel=1e-4)


# --- the model --------------------------------------------------------------------------------


def test_model_ranks_synthetic_latencies_and_round_trips_as_ubjson() -> None:
    task = Task(make_workload("conv2d_nchw", CONV), parse_target("llvm"))
    feats = featurizer(task)
    train_idx, test_idx = sample(task, 600, 3)[:400], sample(task, 600, 3)[400:]
    latency = synthetic_latency(task, train_idx)
    model = CostModel().fit(feats.features(feats.codes(train_idx)), feats.names, latency.min() / latency,
                            np.zeros(len(train_idx), dtype=np.int64))
    test_x = feats.features(feats.codes(test_idx))
    scores = model.predict(test_x, feats.names)
    rho = spearman(scores, -synthetic_latency(task, test_idx))
    assert rho is not None and rho > 0.8

    data = model.to_bytes()
    assert data[:1] == b"{" and not data.startswith(b"\x80")  # UBJSON object, not a pickle
    loaded = CostModel.from_bytes(data)
    assert loaded.feature_names == feats.names
    np.testing.assert_array_equal(loaded.predict(test_x, feats.names), scores)
    # Columns are matched by name: a reordered matrix scores the same.
    order = np.random.default_rng(0).permutation(len(feats.names))
    np.testing.assert_allclose(loaded.predict(test_x[:, order], [feats.names[j] for j in order]), scores)


def test_untrained_model_scores_zero_and_learns_nothing_from_one_label() -> None:
    model = CostModel()
    assert not model.trained and model.predict(np.ones((3, 2), np.float32), ["a", "b"]).tolist() == [0, 0, 0]
    model.fit(np.ones((20, 2), np.float32), ["a", "b"], np.zeros(20), np.zeros(20, dtype=np.int64))
    assert not model.trained
    with pytest.raises(ValueError):
        model.to_bytes()


# --- the store: round trip, corruption ----------------------------------------------------------


def test_model_round_trips_through_the_database_without_pickle(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/f.db")
    row, task = add_task(store, "conv2d_nchw", CONV)
    write(store, row["id"], results_of(task, sample(task, 200, 4)))
    model, data, seconds = train(store.trials_for_family(row["family_key"]), task)
    model_id = store.save_model(row["family_key"], row["id"], model.to_bytes(), model.feature_names, len(data),
                                seconds)
    loaded = load_model(store, family_key(task))
    assert loaded is not None and loaded.model_id == model_id
    stored = store.latest_model(row["family_key"])
    assert stored["model"] == model.to_bytes() and stored["feature_names"] == model.feature_names
    assert stored["training_rows"] == 200
    x = data.features[:50]
    np.testing.assert_array_equal(loaded.model.predict(x, data.feature_names), model.predict(x, data.feature_names))


@pytest.mark.parametrize("corrupt", [b"not a model at all", b"{\x00garbage", "truncated", "overwritten"])
def test_corrupt_stored_model_gives_a_warning_and_a_fresh_model(tmp_path: Path, corrupt: bytes | str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(f"sqlite:///{tmp_path}/f.db")
    row, task = add_task(store, "conv2d_nchw", CONV)
    write(store, row["id"], results_of(task, sample(task, 100, 5)))
    if isinstance(corrupt, str):  # XGBoost's own parser crashes on some of these: the digest stops them
        good = retrain(store, row, task, None, []).current.model.to_bytes()
        mid = len(good) // 2
        corrupt = good[:mid] if corrupt == "truncated" else good[:mid] + bytes([good[mid] ^ 1]) + good[mid + 1:]
    assert isinstance(corrupt, bytes)
    with pytest.raises(CostModelError, match="not a readable XGBoost model"):
        CostModel.from_bytes(corrupt)
    store.save_model(row["family_key"], row["id"], corrupt, ["x"], 1, 0.0)
    with caplog.at_level(logging.WARNING, logger="farm.core.costmodel"):
        loaded = starting_model(store, row)
    assert loaded is not None and not loaded.model.trained and loaded.model_id is None
    assert "starting from a fresh model" in caplog.text and row["family_key"] in caplog.text
    # Tuning goes on: the next retrain replaces it with a good model.
    out = retrain(store, row, task, loaded, results_of(task, sample(task, 10, 6)))
    assert out.current.model.trained and out.rank_corr is None
    assert load_model(store, row["family_key"]).model.trained


# --- retraining at round close ------------------------------------------------------------------


def test_retrain_scores_the_previous_model_and_saves_the_new_one(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/f.db")
    row, task = add_task(store, "conv2d_nchw", CONV)
    assert starting_model(store, row) is None
    rounds = np.array_split(sample(task, 300, 7), 3)
    current = None
    for number, indices in enumerate(rounds):
        results = results_of(task, indices, number)
        write(store, row["id"], results)
        out = retrain(store, row, task, current, results)
        # The round's record: the model that guided it and how well it ranked the round.
        guided_by = current.model_id if current is not None else None
        best = min(r.latency for r in results if r.latency is not None)
        store.add_round(row["id"], number, 100 * (number + 1), best, out.rank_corr, guided_by)
        assert out.training_rows == 100 * (number + 1) and out.training_seconds > 0
        current = out.current
    recorded = store.rounds(row["id"])
    assert [r["rank_corr"] is None for r in recorded] == [True, False, False]
    assert all(r["rank_corr"] > 0.5 for r in recorded[1:])  # failures (every 10th index) are unpredictable
    assert [r["model_id"] for r in recorded] == [None, 1, 2]
    with store.engine.connect() as connection:  # set_model_rank_corr: on the model that guided the round
        corr = dict(connection.exec_driver_sql("select id, rank_corr from cost_models").fetchall())
    assert corr[1] == pytest.approx(recorded[1]["rank_corr"]) and corr[3] is None


def test_one_model_ranks_shapes_it_never_saw(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/f.db")
    for ci, hw in ((16, 28), (64, 7)):
        row, task = add_task(store, "conv2d_nchw", {**CONV, "CI": ci, "CO": ci, "H": hw, "W": hw})
        write(store, row["id"], results_of(task, sample(task, 150, ci)))
    model = retrain(store, row, task, None, []).current.model
    new = Task(make_workload("conv2d_nchw", CONV), parse_target("llvm"))
    rho = rank_correlation(model, new, results_of(new, sample(new, 300, 8)))
    assert rho is not None and rho > 0.7


# --- zero-shot prediction -----------------------------------------------------------------------


@pytest.mark.parametrize("target", ["llvm", "cuda"])
def test_predict_gives_valid_configs_of_an_untuned_shape(tmp_path: Path, target: str) -> None:
    store = open_store(f"sqlite:///{tmp_path}/f.db")
    wl = make_workload("conv2d_nchw", CONV)
    with pytest.raises(FarmError, match="has no cost model yet"):
        predict(wl, parse_target(target), store)
    row, task = add_task(store, "conv2d_nchw", {**CONV, "CI": 64, "CO": 64}, target)
    indices = sample(task, 2000, 9)
    valid = np.array([task.check(task.space.get(int(i))) is None for i in indices])
    results = results_of(task, indices[valid][:200])
    write(store, row["id"], results)
    retrain(store, row, task, None, results)

    start = time.perf_counter()
    found = predict(wl, parse_target(target), store, top=5)
    seconds = time.perf_counter() - start
    assert seconds < 1.0, f"predict took {seconds:.2f} s"
    new = Task(wl, parse_target(target))
    assert len(found) == 5 and len({p.config_index for p in found}) == 5
    assert [p.rank for p in found] == [1, 2, 3, 4, 5] and sorted((p.score for p in found), reverse=True) == [
        p.score for p in found]
    for p in found:
        config = new.space.from_json(p.config)
        assert config.index == p.config_index and new.check(config) is None
    if target == "llvm":  # better than random configs (cuda's valid configs are too few for the synthetic optimum)
        predicted = synthetic_latency(new, np.array([p.config_index for p in found]))
        random = synthetic_latency(new, sample(new, 1000, 10))
        assert predicted.min() < np.percentile(random, 25) and np.median(predicted) < np.median(random)
    assert "#1 score" in render(found) and '"config"' in render(found, as_json=True)


# --- visible learning ---------------------------------------------------------------------------


def test_report_plots_tuning_curves_and_summarises_rounds(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/f.db")
    jobs = []
    for search in ("random", "xgb"):
        job = store.submit(JobRequest.build([("conv2d_nchw", CONV)], "llvm", 48, search=search))
        row = store.tasks(job)[0]
        task = Task.from_json(row)
        current = None
        for number, indices in enumerate(np.array_split(sample(task, 48, 11 + len(jobs)), 3)):
            results = results_of(task, indices, number)
            write(store, row["id"], results)
            out = retrain(store, row, task, current, results)
            best = store.best(row["id"], 1)[0]["latency"]
            store.add_round(row["id"], number, 16 * (number + 1), best, out.rank_corr,
                            current.model_id if current else None)
            current = out.current
        jobs.append(job)

    png = plot_tuning_curves(store, jobs, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = tuning_curves(store, jobs)
    assert [c.label for c in curves] == [f"job {jobs[0]} (random)", f"job {jobs[1]} (xgb)"]
    assert all(len(c.best_us) == 48 and (np.diff(c.best_us[~np.isnan(c.best_us)]) <= 0).all() for c in curves)

    text = rounds_summary(store, jobs[1])
    rounds = store.rounds(store.tasks(jobs[1])[0]["id"])
    assert len(text.splitlines()) == 2 + len(rounds) and "rank corr" in text
    assert f"{rounds[-1]['rank_corr']:.2f}" in text and f"{rounds[-1]['best_latency'] * 1e6:.2f}" in text
    with pytest.raises(FarmError, match="no job 99"):
        plot_tuning_curves(store, [99], tmp_path / "x.png")
    with pytest.raises(FarmError, match="does not exist"):
        plot_tuning_curves(store, jobs, tmp_path / "no" / "x.png")


def test_a_panel_of_many_runs_draws_each_group_as_its_median_in_a_band() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nan = np.nan
    # Group "a": five runs of 4 trials, one failing its first two; "b": four runs, one cut short.
    a = [[9, 5, 5, 2], [nan, nan, 7, 3], [8, 8, 4, 4], [6, 6, 6, 1], [9, 9, 9, 9]]
    b = [[4, 4, 4], [3, 3, 2], [5, 5, 5], [6, 2]]
    curves = [Curve(f"{g} {i}", "w", np.array(run, dtype=float), g) for g, runs in (("a", a), ("b", b))
              for i, run in enumerate(runs)]
    assert len(curves) > MAX_LINES
    fig, ax = plt.subplots()
    draw_panel(ax, curves)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["a: median of 5 runs, p10-p90", "b: median of 4 runs, p10-p90"]
    (line_a, line_b) = ax.get_lines()
    assert line_a.get_ydata().tolist() == [8.5, 7.0, 6.0, 3.0]  # NaN left out of trials 1 and 2
    assert line_b.get_ydata().tolist() == [4.5, 3.5]  # only the trials all of b's runs reached
    draw_panel(ax, curves[:MAX_LINES])  # few enough: a line per run
    assert len(ax.get_lines()) == 2 + MAX_LINES
    plt.close(fig)


def test_xgboost_trains_and_predicts_on_one_thread_also_when_loaded() -> None:
    """A model trained here and one loaded from the store (whose saved config says nothing of
    threads, so XGBoost would take every core) both run on XGB_THREADS: their processes share the
    host with build processes (docs/defaults.md#xgboost-threads)."""
    import json

    import xgboost as xgb

    rng = np.random.default_rng(0)
    model = CostModel().fit(rng.random((64, 4), dtype=np.float32), ["a", "b", "c", "d"], rng.random(64),
                            np.zeros(64, dtype=np.int64))

    def threads(booster: Any) -> int:
        return int(json.loads(booster.save_config())["learner"]["generic_param"]["nthread"])

    assert threads(xgb.Booster(model_file=bytearray(model.to_bytes()))) == 0  # XGBoost's own default: all
    assert threads(model.booster) == XGB_THREADS == 1
    assert threads(CostModel.from_bytes(model.to_bytes()).booster) == XGB_THREADS
