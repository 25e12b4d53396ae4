#!/usr/bin/env bash
# The whole test suite: installs what it needs (.venv, PostgreSQL if none is running, Prometheus,
# Docker and debootstrap for the compose test), checks style with ruff, then runs pytest against
# real PostgreSQL, Ray, TVM RPC servers, Prometheus and Docker. The 25 slowest tests' times close
# the output, so that a run's time can be compared test by test with an earlier one.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup.sh" --with-postgres
ensure_prometheus
ensure_docker
cd "$ROOT"
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q --durations=25 "$@"
