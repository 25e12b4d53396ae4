#!/usr/bin/env bash
# The roles of the farm's image; docker/docker-compose.yml runs one per service.
#   farm-node head          Ray head, the TVM RPC tracker and `farm scheduler`, in one container
#   farm-node gpu-worker    a Ray node joining the head; the scheduler places one worker actor per GPU
#                           on it, and each actor runs the RPC server of its GPU
#   farm-node health ROLE   exit 0 when the role's processes are up (the compose healthchecks)
#   farm-node farm ARGS...  the farm command line
# Environment (defaults in brackets):
#   FARM_DB                 head: the database URL (required; it holds the password, so it is never baked in)
#   FARM_TRACKER            head: the tracker as the workers reach it [head:9190]
#   FARM_RAY_HEAD           gpu-worker: the Ray head [head:6379]
#   FARM_NUM_GPUS           gpu-worker: GPUs this node offers Ray [those visible]; on a CPU-only host,
#                           logical GPUs whose worker actors measure llvm kernels
#   RAY_METRICS_PORT        Prometheus endpoint of each Ray node [8080]
#   RAY_AUTH_MODE, RAY_AUTH_TOKEN   Ray's token authentication: the same token on every node
set -euo pipefail

RUN=/run/farm
RAY_PORT=6379

usage() {
  sed -n '2,16s/^# \{0,1\}//p' "$0"
}

# Stop every child on `docker stop` (init: true delivers the signal to this shell only), and stop
# the container as soon as one of them ends: a head without its scheduler or tracker is not a head.
supervise() {
  trap 'kill -TERM $(jobs -p) 2>/dev/null; wait' TERM INT
  local status=0
  wait -n || status=$?
  echo "farm-node: a process of this node ended (status $status); stopping the others" >&2
  kill -TERM $(jobs -p) 2>/dev/null || true
  wait || true
  exit "$status"
}

port_open() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

case "${1:---help}" in
  head)
    : "${FARM_DB:?set FARM_DB to the farm database URL}"
    tracker=${FARM_TRACKER:-head:9190}
    mkdir -p "$RUN"
    ray start --head --port="$RAY_PORT" --num-gpus=0 --metrics-export-port="${RAY_METRICS_PORT:-8080}" \
      --disable-usage-stats --block &
    python -m tvm.exec.rpc_tracker --host 0.0.0.0 --port "${tracker##*:}" --port-end "$((${tracker##*:} + 1))" &
    for _ in $(seq 120); do port_open "$RAY_PORT" && break; sleep 0.5; done
    farm scheduler --db "$FARM_DB" --tracker "$tracker" --ray-address auto &
    echo $! > "$RUN/scheduler.pid"
    supervise
    ;;
  gpu-worker)
    ray start --address="${FARM_RAY_HEAD:-head:$RAY_PORT}" --metrics-export-port="${RAY_METRICS_PORT:-8080}" \
      ${FARM_NUM_GPUS:+--num-gpus="$FARM_NUM_GPUS"} --disable-usage-stats --block &
    supervise
    ;;
  health)
    case "${2:-}" in
      head)
        tracker=${FARM_TRACKER:-head:9190}
        port_open "$RAY_PORT" && port_open "${tracker##*:}" && kill -0 "$(cat "$RUN/scheduler.pid")" ;;
      gpu-worker) [[ -S /tmp/ray/session_latest/sockets/raylet ]] ;;
      *) echo "farm-node: health head|gpu-worker" >&2; exit 2 ;;
    esac
    ;;
  farm)
    shift
    exec farm "$@"
    ;;
  -h|--help)
    usage
    ;;
  *)
    echo "farm-node: unknown role '$1' (head, gpu-worker, health ROLE, farm ARGS...)" >&2
    exit 2
    ;;
esac
