"""Security: no code from data, no SQL built from strings, no password in any output, and the Ray
cluster the farm starts closed to everyone else. The rows of docs/reliability.md point here."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool

from farm.core.errors import FarmError

ROOT = Path(__file__).resolve().parents[1]
# The project's own code: what it runs, benchmarks and scripts included; the tests are not shipped.
CODE = sorted(p for folder in ("farm", "db", "scheduler", "workers", "deploy", "bench", "scripts")
              for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts)


def _code_lines() -> Iterator[tuple[Path, int, str]]:
    for path in CODE:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0] if path.suffix == ".py" else line
            yield path, number, code


# Nothing read is unpickled or evaluated ----------------------------------------------------------

FORBIDDEN = re.compile(
    r"\bimport (c?pickle|cloudpickle|marshal|shelve|dill)\b|\bfrom (c?pickle|cloudpickle|marshal|shelve|dill) import"
    r"|\b(pickle|cloudpickle|marshal|dill)\.loads?\(|read_pickle\(|allow_pickle\s*=\s*True|yaml\.load\("
    r"|(?<![.\w])(eval|exec)\(|shell\s*=\s*True|os\.system\(|os\.popen\(|subprocess\.getoutput\(")


def test_no_pickle_eval_exec_or_shell_in_the_project() -> None:
    assert len(CODE) > 40  # the glob found the code
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path, n, line in _code_lines()
            if path.suffix == ".py" and FORBIDDEN.search(line)]
    assert hits == []


def test_the_grep_would_catch_each_form() -> None:
    for line in ("import pickle", "x = pickle.loads(b)", "eval(s)", "exec(code)", "run(c, shell=True)",
                 "os.system('ls')", "np.load(f, allow_pickle=True)", "import cloudpickle", "yaml.load(t)"):
        assert FORBIDDEN.search(line), line
    for line in ("connection.exec_driver_sql(q)", "ast.literal_eval(s)", "session.execute(stmt)"):
        assert not FORBIDDEN.search(line), line


# All SQL through SQLAlchemy with bound parameters ----------------------------------------------

SQL_CALLS = {"text", "execute", "exec_driver_sql", "executescript", "executemany"}


def _sql_built_from_values(tree: ast.AST) -> list[int]:
    """Lines where SQL text is built from anything but module constants (ALL_CAPS names):
    an f-string, %-formatting, .format() or + of strings passed to text()/execute()/..."""
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name not in SQL_CALLS:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.JoinedStr):
            values = [v.value for v in arg.values if isinstance(v, ast.FormattedValue)]
            if all(isinstance(v, ast.Name) and v.id.isupper() for v in values):
                continue  # e.g. f"LISTEN {NOTIFY_CHANNEL}": a constant of the module, not a value
            bad.append(node.lineno)
        elif isinstance(arg, ast.BinOp) or (isinstance(arg, ast.Call) and getattr(arg.func, "attr", "") == "format"):
            bad.append(node.lineno)
    return bad


def test_sql_is_never_built_from_values() -> None:
    hits = []
    for path in CODE:
        if path.suffix == ".py":
            hits += [f"{path.relative_to(ROOT)}:{n}" for n in _sql_built_from_values(ast.parse(path.read_text()))]
    assert hits == []


def test_the_sql_check_would_catch_each_form() -> None:
    for src in ('text(f"SELECT * FROM t WHERE id = {job_id}")', 'c.execute("DELETE FROM t WHERE x = %s" % x)',
                'c.exec_driver_sql("SELECT {}".format(x))', 'text("SELECT " + name)'):
        assert _sql_built_from_values(ast.parse(src)) == [1], src
    for src in ('text("SELECT 1 WHERE id = :id")', 'c.execute(f"PRAGMA busy_timeout={TIMEOUT_MS}")'):
        assert _sql_built_from_values(ast.parse(src)) == [], src


# Passwords: masked everywhere, or never in a URL at all ------------------------------------------


@pytest.fixture
def pg_password_url(pg_server: str) -> Iterator[tuple[str, str]]:
    """(URL with a password, the password): a role with that password, owning a fresh database.
    The server may trust 127.0.0.1 and never check the password: what matters is where it shows."""
    suffix = uuid.uuid4().hex[:10]
    role, password, database = f"farm_pw_{suffix}", f"sekret-{uuid.uuid4().hex}", f"farm_test_pw_{suffix}"
    admin = create_engine(pg_server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as connection:
        # DDL takes no bound parameters; every value here is made by this fixture.
        connection.execute(text(f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{password}'"))
        connection.execute(text(f'CREATE DATABASE "{database}" OWNER "{role}"'))
    url = make_url(pg_server).set(username=role, password=password, host="127.0.0.1", database=database)
    try:
        yield url.render_as_string(hide_password=False), password
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
            connection.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
        admin.dispose()


def _farm(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "farm", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600, env=env)


@pytest.mark.slow
def test_password_in_the_url_never_appears_anywhere(pg_password_url: tuple[str, str], tmp_path: Path) -> None:
    """A real job through the CLI with a password in its Postgres URL, then every command that
    reads it back, a failing one among them; no output, log, Ray session file or stored error
    holds the password."""
    url, password = pg_password_url
    logs, ray_tmp = tmp_path / "logs", Path(tempfile.mkdtemp(prefix="farmray", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}  # Ray's session logs, to search them too
    try:
        outputs = []
        for args in (["tune", "matmul", "M=16", "N=16", "K=16", "--trials", "4", "--search", "random",
                      "--log-dir", str(logs), "--export", str(tmp_path / "best.json"), "-v"],
                     ["jobs"], ["status", "1", "--json"], ["status", "1"], ["trials", "1", "--json"],
                     ["export", "1", "-o", str(tmp_path / "again.json")], ["status", "404"], ["db", "upgrade"],
                     ["submit", "matmul", "M=4", "N=4", "K=4", "--target", '{"kind": "cuda", "arch": "sm_999"}']):
            proc = _farm(*args, "--db", url, cwd=tmp_path, env=env)
            outputs += [proc.stdout, proc.stderr]
            assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "best for matmul" in outputs[0] and "no job 404" in "".join(outputs)
        assert "***" in "".join(outputs)  # the URL is shown, masked (farm db upgrade)
        for text_ in outputs:
            assert password not in text_
        for folder in (logs, ray_tmp, tmp_path):
            for path in folder.rglob("*"):
                if path.is_file() and not path.is_socket():
                    assert password.encode() not in path.read_bytes(), path
        engine = create_engine(url, poolclass=NullPool)
        with engine.connect() as connection:
            stored = connection.execute(text("SELECT error FROM trials UNION ALL SELECT error FROM jobs "
                                             "UNION ALL SELECT CAST(spec AS TEXT) FROM jobs")).scalars().all()
        engine.dispose()
        assert stored and not any(password in (value or "") for value in stored)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_client_errors_and_db_upgrade_mask_the_password(pg_password_url: tuple[str, str], tmp_path: Path) -> None:
    from farm.client import Client

    url, password = pg_password_url
    with Client(url, in_process=False) as client:
        with pytest.raises(FarmError) as error:
            client.job(404)
        assert "no job 404" in str(error.value) and password not in str(error.value) and "***" in str(error.value)
        assert password not in repr(client.store) and password not in client.url
    proc = _farm("db", "upgrade", "--db", url, cwd=tmp_path)
    assert proc.returncode == 0 and "***" in proc.stdout and password not in proc.stdout + proc.stderr
    bad = make_url(url).set(port=1).render_as_string(hide_password=False)
    proc = _farm("jobs", "--db", bad, cwd=tmp_path)
    assert proc.returncode == 2 and "***" in proc.stderr and password not in proc.stderr


def test_password_file_is_read_at_connect_time(pg_password_url: tuple[str, str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """FARM_DB_PASSWORD_FILE: the URL carries no password (not in `ps`, not in a pickled store);
    the engine connects with the file's."""
    from db.engine import make_engine
    from db.store import open_store

    url, password = pg_password_url
    bare = url.replace(f":{password}@", "@")
    assert password not in bare
    secret = tmp_path / "pw"
    secret.write_text(password + "\n")
    monkeypatch.setenv("FARM_DB_PASSWORD_FILE", str(secret))
    engine = make_engine(bare)
    assert engine.url.password == password
    engine.dispose()
    store = open_store(bare)
    assert store.jobs() == [] and password not in store.url
    store.close()
    for content, message in ((None, "cannot read the database password"), ("", "is empty")):
        if content is None:
            secret.unlink()
        else:
            secret.write_text(content)
        with pytest.raises(FarmError, match=message):
            make_engine(bare)
    proc = _farm("jobs", "--db", bare, cwd=tmp_path, env={**os.environ, "FARM_DB_PASSWORD_FILE": str(secret)})
    assert proc.returncode == 2 and "is empty" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# The Ray cluster the farm starts ---------------------------------------------------------------

_RAY_PROBE = textwrap.dedent("""
    import json, os, subprocess, sys
    import ray  # imported first, as a library might: init_ray must still take effect
    import psutil
    from scheduler.cluster import init_ray

    init_ray()
    from ray._raylet import AuthenticationMode, get_authentication_mode

    me = psutil.Process()
    pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
    listening = sorted({c.laddr.ip for c in psutil.net_connections("inet")
                        if c.status == psutil.CONN_LISTEN and c.pid in pids})

    @ray.remote
    def add(a, b):
        return a + b

    gcs = ray.get_runtime_context().gcs_address
    probe = "from ray._raylet import GcsClient; GcsClient(address=%r).internal_kv_keys(b'', None, 10); print('IN')"
    outsiders = {}
    for name, extra in {"no token": {"RAY_AUTH_MODE": "disabled"},
                        "wrong token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token"},
                        "the token": {"RAY_AUTH_MODE": "token"}}.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        proc = subprocess.run([sys.executable, "-c", probe % gcs], env={**env, **extra}, capture_output=True,
                              text=True, timeout=60)
        outsiders[name] = "IN" in proc.stdout
    print(json.dumps({"mode_is_token": get_authentication_mode() == AuthenticationMode.TOKEN,
                      "listening": listening, "gcs": gcs, "task": ray.get(add.remote(40, 2)),
                      "outsiders": outsiders}))
    ray.shutdown()
""")


@pytest.mark.slow
def test_local_ray_listens_on_loopback_only_and_requires_its_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_MODE"] = "disabled"  # a user's setting: the cluster the farm starts still requires the token
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", _RAY_PROBE], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["task"] == 42 and result["gcs"].startswith("127.0.0.1:")
    assert result["listening"] and set(result["listening"]) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, result
    assert result["mode_is_token"]
    # Refused without the token or with another; the token ray.init saved (~/.ray/auth_token) lets in.
    assert result["outsiders"] == {"no token": False, "wrong token": False, "the token": True}, result
