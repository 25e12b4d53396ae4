"""A PostgreSQL cluster of a test's own, which it may stop and start (the shared server on
127.0.0.1:5432 serves other tests and people: never stop that one).

Initialised with initdb in a fresh folder under /tmp (as the `postgres` user when running as root:
PostgreSQL refuses to run as root, and pytest's own temp folders are closed to other users), on a
free loopback port, trust authentication, fsync off. The server is started and stopped with
pg_ctl, so it is a daemon of its own rather than a child of the test: it carries the test session's
environment, and the suite's check that nothing is left running (tests/conftest.py) sees it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from sqlalchemy import create_engine, make_url
from sqlalchemy.pool import NullPool

from deploy.cluster import _postgres_bin
from farm.core.host import free_port


class PrivatePostgres:
    """One private cluster; `start()`, `stop()`, `url(database)`, `create_database()`, `remove()`."""

    def __init__(self) -> None:
        self.bin = _postgres_bin()
        self.user = "postgres" if os.geteuid() == 0 else None
        self.folder = Path(tempfile.mkdtemp(prefix="farm-test-pg-"))
        self.data = self.folder / "data"
        self.log = self.folder / "server.log"
        self.port = free_port()
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.folder, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync", "--no-instructions")
        self.running = False

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([str(self.bin / tool), *args], user=self.user, capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed: {(done.stderr or done.stdout).strip()[-2000:]}")

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.data} "
                   "-c fsync=off -c full_page_writes=off")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")
        self.running = True

    def stop(self) -> None:
        """Stop it as an administrator would for a restart (fast: sessions are terminated)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
        self.running = False

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create database `name`; its URL."""
        engine = create_engine(make_url(self.url()).set(drivername="postgresql+psycopg2"),
                               isolation_level="AUTOCOMMIT", poolclass=NullPool)
        with engine.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        engine.dispose()
        return self.url(name)

    def remove(self) -> None:
        """Stop the server if it runs, and delete the cluster."""
        if self.running:
            self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
