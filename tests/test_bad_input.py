"""Bad input, as a new user or a hostile file gives it: one clear line, a non-zero exit (status 2 on
the command line) or a FarmError from the Python client, and the database unchanged. The rows of
docs/reliability.md point here.

Property-based tests (hypothesis) feed arbitrary JSON values to every parser of user input: the
job spec (JobRequest.build), workload parameters, targets, configs (ConfigSpace.from_json),
exports and stored cost models. Only FarmError or success may come out, never another exception.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.pool import NullPool

from farm.core.costmodel import CostModel, CostModelError
from farm.core.errors import FarmError
from farm.core.features import featurizer
from farm.core.jobspec import MAX_TRIALS, JobRequest
from farm.core.search import XGBSearch
from farm.core.space import MAX_KNOB_VALUES, SplitKnob
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.untrusted import MAX_JSON_DEPTH, parse_json
from farm.core.workloads import make_workload
from farm.export import validate

MATMUL = ("matmul", {"M": 16, "N": 16, "K": 16})
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def farm(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "farm", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def _only_farm_errors(call: Any, *args: Any, **kwargs: Any) -> None:
    try:
        call(*args, **kwargs)
    except FarmError as e:
        assert "\n" not in str(e) and len(str(e)) < 1000, str(e)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A farm database with the current schema, on each backend."""
    if request.param == "sqlite":
        from db.migrate import upgrade

        url = f"sqlite:///{tmp_path}/farm.db"
        upgrade(url)
        return url
    return request.getfixturevalue("pg_url")


def _rows(url: str) -> dict[str, int]:
    """Row counts of the tables a submit writes."""
    engine = create_engine(url, poolclass=NullPool)
    with engine.connect() as connection:
        counts = {table: connection.execute(select(func.count()).select_from(text(table))).scalar_one()
                  for table in ("jobs", "tasks", "trials")}
    engine.dispose()
    return counts


# The job spec, from the Python client ----------------------------------------------------------

BAD_SPECS = [
    # (keyword arguments of Client.submit, words the one-line message must hold)
    (dict(trials=10**12), "trials must be an integer in [1, 1,000,000,000]"),
    (dict(trials=MAX_TRIALS + 1), "trials must be an integer"),
    (dict(trials=True), "trials must be an integer"),
    (dict(trials=0), "trials must be an integer"),
    (dict(trials=-5), "trials must be an integer"),
    (dict(trials=2.5), "trials must be an integer"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(seed=-1), "seed must be an integer"),
    (dict(workers=10**6), "workers must be an integer in [1, 1,024]"),
    (dict(workers=0), "workers must be an integer"),
    (dict(batch_size=0), "batch size"),
    (dict(rpc_keys="abc"), "rpc_keys must be a list, got str"),
    (dict(rpc_keys=["gpu 0"]), "RPC key"),
    (dict(rpc_keys=["a\0b"]), "RPC key"),
    (dict(rpc_keys=["k" * 201]), "RPC key"),
    (dict(rpc_keys=["a", "a"]), "twice"),
    (dict(name="n" * 201), "at most 200 printable characters"),
    (dict(name="a\0b"), "at most 200 printable characters"),
    (dict(name=5), "at most 200 printable characters"),
    (dict(search="annealing"), "unknown search"),
    (dict(search="xgb:screen=0"), "screen must lie in [1, 1024], got 0"),
    (dict(search="xgb:epsilon=nan"), "epsilon must lie in [0, 1]"),
    (dict(search="xgb:screen=1.5"), "screen takes an integer"),
    (dict(search="xgb:temperature=2"), "unknown option 'temperature' of search 'xgb'"),
    (dict(search="xgb:screen=8,screen=8"), "give each option once"),
    (dict(search="xgb:screen"), "give each option once"),
    (dict(search="random:epsilon=0.5"), "its options: none"),
    (dict(search="xgb:" + "screen=32," * 4), "at most 32 characters"),
    (dict(search=None), "a search is a string"),
    (dict(workloads=[None]), "a workload is a name"),
    (dict(workloads="matmul"), "workloads must be a list"),
    (dict(workloads=[]), "at least one workload"),
    (dict(workloads=[("matmul", {"M": 2**40, "N": 4, "K": 4})]), "bound of 1,048,576 on every extent"),
    (dict(workloads=[("matmul", {"M": 0, "N": 4, "K": 4})]), "must be >= 1"),
    (dict(workloads=[("matmul", {"M": -1, "N": 4, "K": 4})]), "must be >= 1"),
    (dict(workloads=[("matmul", {"M": True, "N": 4, "K": 4})]), "must be an integer"),
    (dict(workloads=[("matmul", {"M": 4, "N": 4, "K": 4, "Q": 1})]), "unknown parameter"),
    (dict(workloads=[("matmul", {"M": 2**20, "N": 2**20, "K": 4})]), "elements"),
    (dict(workloads=[("matmul", {"M": 4, "N": 4, "K": 4, "dtype": "int8"})]), "not one of"),
    (dict(workloads=[("matmul", [1, 2])]), "a workload is a name"),
    # int() takes these; they would store a value the user did not write
    (dict(workloads=[("matmul", {"M": "1_6", "N": 4, "K": 4})]), "with the digits 0-9, got '1_6'"),
    (dict(workloads=[("matmul", {"M": "١٦", "N": 4, "K": 4})]), "with the digits 0-9"),
    (dict(workloads=[("matmul", {"M": " 8", "N": 4, "K": 4})]), "with the digits 0-9"),
    (dict(workloads=[("matmul", {"M": "+8", "N": 4, "K": 4})]), "with the digits 0-9"),
    (dict(target={"kind": "cuda", "arch": "sm_999"}), "not one the farm compiles for"),
    (dict(target='{"kind": "llvm", "num-cores": -4}'), "num-cores=-4 must be an integer in [1, 1024]"),
    (dict(target={"kind": "cuda", "max_threads_per_block": 10**9}), "max_threads_per_block"),
    (dict(target="rocm"), "unknown target"),
    (dict(target=None), "target must be"),
    (dict(target='{"kind": "llvm", "x": ' + "[" * 5000), "target"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_SPECS)
def test_client_refuses_bad_specs_with_one_line_and_writes_nothing(db_url: str, kwargs: dict[str, Any],
                                                                   message: str) -> None:
    from farm.client import Client

    before = _rows(db_url)
    spec: dict[str, Any] = {"workloads": [MATMUL], "target": "llvm", "trials": 16, **kwargs}
    with Client(db_url, in_process=False) as client, pytest.raises(FarmError) as error:
        client.submit(spec.pop("workloads"), spec.pop("target"), spec.pop("trials"), **spec)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert _rows(db_url) == before


def test_sqlite_and_postgres_refuse_the_same_budget(tmp_path: Path, pg_url: str) -> None:
    """A budget the farm takes fits both databases; one past the bound is refused by both alike."""
    from farm.client import Client

    for url in (f"sqlite:///{tmp_path}/farm.db", pg_url):
        with Client(url, in_process=False) as client:
            job = client.submit([MATMUL], "llvm", MAX_TRIALS)
            assert job.status()["trials_budget"] == MAX_TRIALS
            with pytest.raises(FarmError, match="trials must be an integer"):
                client.submit([MATMUL], "llvm", MAX_TRIALS + 1)


def test_huge_extent_is_refused_before_any_enumeration() -> None:
    start = time.perf_counter()
    with pytest.raises(FarmError, match="bound"):
        JobRequest.build([("matmul", {"M": 2**40, "N": 64, "K": 64})], "cuda", 16)
    # The largest extent allowed, on the template with the most knobs: counted, never listed.
    request = JobRequest.build([("matmul", {"M": 997_920, "N": 2079, "K": 1024})], "cuda", 16)
    assert request.tasks[0].space.size > 10**10
    assert time.perf_counter() - start < 20


def test_a_split_with_too_many_values_is_refused_uncounted() -> None:
    with pytest.raises(FarmError, match="per knob"):
        SplitKnob("tile", 2**60, 8)  # C(67, 7) ways: counted from the exponents, never listed
    assert len(SplitKnob("tile", 997_920, 4)) <= MAX_KNOB_VALUES


# The job spec, from the command line ------------------------------------------------------------

BAD_SUBMITS = [
    (["--trials", "1000000000000"], "trials must be an integer in [1, 1,000,000,000]"),
    (["--workers", "1000000"], "workers must be an integer"),
    (["--seed", "x"], "seed"),
    (["--target", '{"kind": "cuda", "arch": "sm_999"}'], "not one the farm compiles for"),
    (["--target", '{"kind": "llvm", "num-cores": -4}'], "num-cores=-4"),
    (["--name", "n" * 201], "at most 200 printable characters"),
    (["--rpc-key", "gpu 0"], "RPC key"),
]


@pytest.mark.parametrize(("args", "message"), BAD_SUBMITS)
def test_cli_submit_refuses_with_one_line_exit_2_and_writes_nothing(db_url: str, tmp_path: Path, args: list[str],
                                                                    message: str) -> None:
    before = _rows(db_url)
    proc = farm("submit", "matmul", "M=16", "N=16", "K=16", *args, "--db", db_url, cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert _rows(db_url) == before


@pytest.mark.parametrize(("words", "message"), [
    (["M=1", "M=2"], "parameter 'M' is given twice (M=1 and M=2): give it once"),
    (["M= 8"], "holds whitespace"),
    (["M =8"], "holds whitespace"),
    (["M=1_6"], "with the digits 0-9, got '1_6'"),
    (["M=١٦"], "with the digits 0-9"),
    (["M=0x10"], "with the digits 0-9"),
])
def test_cli_refuses_malformed_parameters_in_one_line(db_url: str, tmp_path: Path, words: list[str],
                                                      message: str) -> None:
    """`M=1 M=2` was stored as M=2, and `M= 8`, `M=1_6`, `M=١٦` as 8 and 16, without a word."""
    before = _rows(db_url)
    for command in ("submit", "tune"):
        others = [w for w in ("N=16", "K=16") if w[0] not in {x[0] for x in words}]
        proc = farm(command, "matmul", *words, *others, "--db", db_url, cwd=tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (command, proc.stderr)
    assert _rows(db_url) == before


def test_cli_huge_extent_is_refused_at_once_and_creates_no_database(tmp_path: Path) -> None:
    start = time.perf_counter()
    proc = farm("submit", "matmul", f"M={2**40}", "N=64", "K=64", "--db", f"sqlite:///{tmp_path}/farm.db",
                cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "bound" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert time.perf_counter() - start < 60
    assert list(tmp_path.iterdir()) == []


# Property-based: arbitrary values into every parser ---------------------------------------------


@FAST
@given(workloads=JSON, target=JSON, trials=JSON, seed=JSON, workers=JSON, rpc_keys=JSON, name=JSON)
def test_job_request_build_raises_only_farm_errors(workloads: Any, target: Any, trials: Any, seed: Any,
                                                   workers: Any, rpc_keys: Any, name: Any) -> None:
    _only_farm_errors(JobRequest.build, workloads, target, trials, seed=seed, workers=workers, rpc_keys=rpc_keys,
                      name=name)


@FAST
@given(params=st.dictionaries(st.sampled_from(["M", "N", "K", "dtype", "x"]), JSON, max_size=5))
def test_workload_params_raise_only_farm_errors(params: dict[str, Any]) -> None:
    _only_farm_errors(make_workload, "matmul", params)
    _only_farm_errors(make_workload, "seed-maxpool", params)


@FAST
@given(target=JSON | st.text(max_size=40))
def test_parse_target_raises_only_farm_errors(target: Any) -> None:
    _only_farm_errors(parse_target, target)


@pytest.fixture(scope="module")
def cuda_matmul() -> Task:
    return Task(make_workload("matmul", {"M": 64, "N": 48, "K": 32}), parse_target("cuda"))


@FAST
@given(config=JSON, knob_values=st.dictionaries(
    st.sampled_from(["tile_i", "tile_j", "tile_k", "auto_unroll_max_step", "unroll_explicit"]), JSON))
def test_config_from_json_raises_only_farm_errors(cuda_matmul: Task, config: Any, knob_values: dict[str, Any]) -> None:
    _only_farm_errors(cuda_matmul.space.from_json, config)
    _only_farm_errors(cuda_matmul.space.from_json, knob_values)


def test_config_from_json_is_strict_about_types(cuda_matmul: Task) -> None:
    good = cuda_matmul.space.get(12345).to_json()
    assert cuda_matmul.space.from_json(good).index == 12345
    for knob, value in [("tile_i", [float(v) for v in good["tile_i"]]), ("unroll_explicit", True),
                        ("tile_k", [str(v) for v in good["tile_k"]]), ("auto_unroll_max_step", 0.0)]:
        with pytest.raises(FarmError, match="is not one of its values"):
            cuda_matmul.space.from_json({**good, knob: value})


# Exports ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def export_doc(cuda_matmul: Task) -> dict[str, Any]:
    return {"format": "farm.best/1", "records": [{
        "workload": cuda_matmul.workload.to_json(), "target": cuda_matmul.target.to_json(),
        "template": cuda_matmul.template.name, "template_version": cuda_matmul.template.version,
        "config": cuda_matmul.space.get(7).to_json(), "latency_us": 12.5, "device": "NVIDIA H200",
    }]}


@FAST
@given(doc=JSON)
def test_export_validation_raises_only_farm_errors(doc: Any) -> None:
    _only_farm_errors(validate, doc)


@FAST
@given(field=st.sampled_from(["workload", "target", "template", "template_version", "config", "latency_us",
                              "device"]), value=JSON)
def test_tampered_export_fields_raise_only_farm_errors(export_doc: dict[str, Any], field: str, value: Any) -> None:
    doc = copy.deepcopy(export_doc)
    doc["records"][0][field] = value
    _only_farm_errors(validate, doc)


@FAST
@given(cut=st.integers(min_value=0))
def test_truncated_exports_are_refused_in_one_line(export_doc: dict[str, Any], cut: int) -> None:
    text = json.dumps(export_doc)
    cut %= len(text)
    with pytest.raises(FarmError):
        validate(parse_json(text[:cut], "export"))


@pytest.mark.parametrize(("text", "message"), [
    ("[" * 100_000 + "]" * 100_000, "nests deeper"),
    ('{"format": "farm.best/1", "records": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1) + "}",
     "nests deeper"),
    ('{"format": NaN}', "NaN is not a JSON number"),
    ("\xff\xfe", "not valid JSON"),
])
def test_hostile_export_files_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "best.json"
    path.write_text(text, encoding="latin-1")
    proc = farm("export", "--merge", str(path), "-o", str(tmp_path / "out.json"), cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr[-2000:]
    assert not (tmp_path / "out.json").exists()


def test_export_with_two_records_for_one_key_is_refused_naming_it(export_doc: dict[str, Any]) -> None:
    doc = copy.deepcopy(export_doc)
    second = copy.deepcopy(doc["records"][0])
    second["latency_us"] = 3.0
    second["workload"]["params"].pop("dtype")  # the default spelled out or not: the same key
    doc["records"].append(second)
    with pytest.raises(FarmError, match=r"records 0 and 1 are both the best of workload .*matmul.*NVIDIA H200"):
        validate(doc)
    second["device"] = "NVIDIA H100"
    validate(doc)  # another device: another key


@pytest.mark.parametrize(("where", "message"), [
    ("record", "record 0: unknown field(s) ['configs']; a record holds config, device"),
    ("document", "unknown top-level field(s) ['note']; a farm.best/1 document holds only format, records"),
])
def test_export_with_an_unknown_field_is_refused_naming_it(export_doc: dict[str, Any], where: str,
                                                          message: str) -> None:
    """An extra field (a typo of one, or a newer farm's) was applied without a word."""
    doc = copy.deepcopy(export_doc)
    if where == "record":
        doc["records"][0]["configs"] = doc["records"][0]["config"]
    else:
        doc["note"] = "tuned on Tuesday"
    with pytest.raises(FarmError) as error:
        validate(doc, "best.json")
    assert message in str(error.value), str(error.value)


@pytest.mark.parametrize("latency", [10**400, -1, 0, 1e300, True, "12"])
def test_export_latency_out_of_range_is_refused(export_doc: dict[str, Any], latency: Any) -> None:
    doc = copy.deepcopy(export_doc)
    doc["records"][0]["latency_us"] = latency
    with pytest.raises(FarmError, match="latency_us"):
        validate(doc)


# Stored cost models -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_bytes(cuda_matmul: Task) -> bytes:
    feats = featurizer(cuda_matmul)
    rng = np.random.default_rng(0)
    indices = rng.choice(cuda_matmul.space.size, 200, replace=False)
    x = feats.features(feats.codes(indices))
    return CostModel().fit(x, feats.names, rng.uniform(0.1, 1.0, 200), np.zeros(200, dtype=np.int64)).to_bytes()


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_are_no_cost_model(data: bytes) -> None:
    with pytest.raises(CostModelError):
        CostModel.from_bytes(data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.integers(min_value=0), byte=st.integers(min_value=0, max_value=255), cut=st.booleans())
def test_truncated_or_tampered_cost_models_are_refused(model_bytes: bytes, at: int, byte: int, cut: bool) -> None:
    at %= len(model_bytes)
    if cut:
        damaged = model_bytes[:at]
    else:
        if model_bytes[at] == byte:
            byte ^= 1
        damaged = model_bytes[:at] + bytes([byte]) + model_bytes[at + 1:]
    with pytest.raises(CostModelError):
        CostModel.from_bytes(damaged)


def test_deeply_nested_cost_model_is_refused() -> None:
    nested = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(CostModelError):
        CostModel.from_bytes(nested)


# farm predict --top K ---------------------------------------------------------------------------


@pytest.mark.parametrize(("workload", "params", "target"), [
    ("matmul", {"M": 512, "N": 512, "K": 512}, "cuda"),  # annealing over a space of 16 million
    ("matmul", {"M": 512, "N": 512, "K": 512}, "llvm"),  # small enough to score whole
    ("seed-depthwise", {}, "cuda"),
])
def test_predicted_best_does_not_depend_on_top(workload: str, params: dict[str, Any], target: str) -> None:
    task = Task(make_workload(workload, params), parse_target(target))
    feats = featurizer(task)
    rng = np.random.default_rng(0)
    indices = rng.choice(task.space.size, 2000, replace=False)
    x = feats.features(feats.codes(indices))
    latency = np.exp(np.nan_to_num(x) @ rng.normal(size=x.shape[1]) * 0.01)
    model = CostModel().fit(x, feats.names, latency.min() / latency, np.zeros(len(x), dtype=np.int64))
    answers = {}
    for top in (1, 2, 5, 33, 64):
        search = XGBSearch(task, task.space.shards(1)[0], 0, epsilon=0.0)
        search.set_model(model)
        ranked = search.ranked(top)
        scores = model.predict(feats.features(feats.codes(ranked)), feats.names)
        assert len(ranked) == top and list(scores) == sorted(scores, reverse=True)
        assert all(task.check(task.space.get(i)) is None for i in ranked)
        answers[top] = ranked[0]
    assert len(set(answers.values())) == 1, answers


# Database schema versions -----------------------------------------------------------------------


@pytest.fixture
def newer_db(db_url: str) -> Iterator[str]:
    """A farm database stamped with a schema revision this farm does not have."""
    engine = create_engine(db_url, poolclass=NullPool)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = :rev"), {"rev": "9999_from_the_future"})
    engine.dispose()
    yield db_url


@pytest.mark.parametrize("command", [["jobs"], ["db", "upgrade"], ["status", "1"],
                                     ["submit", "matmul", "M=4", "N=4", "K=4"]])
def test_database_of_a_newer_farm_is_one_line(newer_db: str, tmp_path: Path, command: list[str]) -> None:
    proc = farm(*command, "--db", newer_db, cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "written by a newer farm" in lines[0] and "9999_from_the_future" in lines[0], lines
    assert _rows(newer_db) == {"jobs": 0, "tasks": 0, "trials": 0}


def test_database_with_tables_but_no_revision_is_one_line(db_url: str, tmp_path: Path) -> None:
    engine = create_engine(db_url, poolclass=NullPool)
    with engine.begin() as connection:
        connection.execute(text("DROP TABLE alembic_version"))
    engine.dispose()
    proc = farm("jobs", "--db", db_url, cwd=tmp_path)
    assert proc.returncode == 2 and "no farm schema revision" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_older_schema_that_cannot_be_migrated_says_run_farm_db_upgrade(pg_empty_url: str, tmp_path: Path) -> None:
    """An empty (older) database and a user who may not create tables: the migration every command
    runs first fails, in one line that says what to run."""
    from sqlalchemy import make_url

    role = f"farm_ro_{uuid.uuid4().hex[:8]}"
    admin = create_engine(pg_empty_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as connection:
        connection.execute(text(f'CREATE ROLE "{role}" LOGIN'))
        connection.execute(text("REVOKE CREATE ON SCHEMA public FROM PUBLIC"))
    url = make_url(pg_empty_url).set(username=role).render_as_string(hide_password=False)
    try:
        proc = farm("jobs", "--db", url, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot migrate" in lines[0] and "farm db upgrade" in lines[0], lines
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP OWNED BY "{role}"'))
        admin.dispose()
        # The role outlives the test database only until it is dropped (after the database).
        drop = create_engine(make_url(pg_empty_url).set(database="postgres"), isolation_level="AUTOCOMMIT",
                             poolclass=NullPool)
        with drop.connect() as connection:
            connection.execute(text(f'SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '
                                    f"'{role}'"))
            connection.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
        drop.dispose()


@pytest.mark.parametrize("url", ["postgresql://postgres@127.0.0.1:1/farm", "mysql://x@y/z", "not a url",
                                 "postgresql://postgres@127.0.0.1:5432/no_such_farm_database"])
def test_unreachable_or_wrong_database_urls_are_one_line(tmp_path: Path, url: str) -> None:
    proc = farm("submit", "matmul", "M=4", "N=4", "K=4", "--db", url, cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# Output paths ------------------------------------------------------------------------------------

# Where nothing can be written, though root passes every permission check there.
UNWRITABLE = "/proc/farm-forbidden"


@pytest.mark.parametrize(("args", "message"), [
    (["tune", "matmul", "M=16", "N=16", "K=16", "--log-dir", UNWRITABLE], f"cannot make folder {UNWRITABLE}"),
    (["tune", "matmul", "M=16", "N=16", "K=16", "--export", f"{UNWRITABLE}.json"], f"cannot write {UNWRITABLE}.json"),
    (["tune", "matmul", "M=16", "N=16", "K=16", "--export", "."], "it is a folder"),
    (["export", "1", "-o", f"{UNWRITABLE}.json"], f"cannot write {UNWRITABLE}.json"),
    (["export", "1", "-o", f"{UNWRITABLE}/msdb", "--format", "metaschedule"], "does not exist"),
    (["export", "1", "-o", "/proc/msdb", "--format", "metaschedule"], "cannot write /proc/msdb"),
    (["build", "matmul", "M=16", "N=16", "K=16", "-o", "/proc/k.so"], "cannot write /proc/k.so"),
    (["report", "1", "-o", "/proc/curve.png"], "cannot write /proc/curve.png"),
    (["predict", "matmul", "M=16", "N=16", "K=16", "--measure", "--log-dir", UNWRITABLE], "cannot make folder"),
    (["scheduler", "--once", "--log-dir", UNWRITABLE], "cannot make folder"),
])
def test_an_output_that_cannot_be_written_is_one_line_and_writes_nothing(db_url: str, tmp_path: Path,
                                                                         args: list[str], message: str) -> None:
    """Every output path is checked before anything is submitted or written: `--log-dir
    /proc/...` was a 75-line FileNotFoundError with the job left queued; `export -o` and `build -o`
    were tracebacks."""
    before = _rows(db_url)
    uses_db = args[0] != "build"
    proc = farm(*args, *(["--db", db_url] if uses_db else []), cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-3000:]
    assert _rows(db_url) == before
    assert not [p for p in tmp_path.iterdir() if p.name != "farm.db"]


def test_a_file_whose_writing_fails_is_not_left_half_written(tmp_path: Path) -> None:
    """A write that fails midway (here the JSON encoder, after part of the document) leaves no
    file, nor a temporary one; one that existed keeps its content."""
    from farm.export import write_json_atomic

    bad = {"records": [{"latency_us": 1.0}] * 1000, "z": object()}  # sort_keys: "z" is written last
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "best.json", bad)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "best.json").write_text('{"format": "farm.best/1", "records": []}\n')
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "best.json", bad)
    assert [p.name for p in tmp_path.iterdir()] == ["best.json"]
    assert json.loads((tmp_path / "best.json").read_text()) == {"format": "farm.best/1", "records": []}
