#!/usr/bin/env bash
# Two bench/gpu_session.sh runs at once on a 2-GPU machine, one per GPU (CUDA_VISIBLE_DEVICES),
# for steps that need one GPU each (check, kernels, fsearch, vsms; not e2e, which takes both):
#   bash bench/gpu_parallel.sh OUTDIR "STEPS ON GPU 0" "STEPS ON GPU 1"
# Each run writes to OUTDIR/gpu0 or OUTDIR/gpu1 with the environment's settings (KERNEL_CASES,
# VSMS_CASES, ...), and a setting prefixed GPU0_ or GPU1_ applies to that run alone, over the
# plain one (GPU1_VSMS_CASES="resnet-last-conv" while GPU 0 takes VSMS_CASES); OUTDIR/DONE
# appears when both have ended, for bench/gpu_collect.sh.
# Each run is pinned (taskset) to its own half of the cores this script may use, and the farm
# and vs_metaschedule's MetaSchedule size their build pools by the cores they may use
# (farm.core.host): each run is a one-GPU machine of half the cores. Unpinned, both sized their
# pools by the whole host, and beside a farm job 504 of MetaSchedule's 512 builds outlasted its
# 30 s timeout (docs/benchmarks/kernels-2026-11-26g.md). Their tuning wall times are those of
# such a half machine, not of a job alone on the host; the kernels' latencies, timed on their
# own GPUs, are the same.
set -uo pipefail
OUT=${1:?output folder}; STEPS0=${2:?steps for GPU 0}; STEPS1=${3:?steps for GPU 1}
# The cores this script may run on, as taskset lists them (e.g. "0-31"), split into two halves.
mapfile -t cores < <(python3 -c "import os; print(*sorted(os.sched_getaffinity(0)), sep='\n')")
half=$(( ${#cores[@]} / 2 ))
if (( half == 0 )) || ! command -v taskset > /dev/null; then
  echo "gpu_parallel.sh: needs taskset and 2 cores or more to give each GPU's run cores of its own" >&2; exit 2
fi
list() { local IFS=,; echo "$*"; }
# Run n's own settings: each GPU<n>_NAME=value of the environment as NAME=value (NUL-separated).
own() { local v; for v in $(compgen -e); do [[ $v == GPU$1_* ]] && printf '%s=%s\0' "${v#GPU"$1"_}" "${!v}"; done; }
mapfile -d '' env0 < <(own 0); mapfile -d '' env1 < <(own 1)
mkdir -p "$OUT"; rm -f "$OUT/DONE"
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck disable=SC2086  # each list of steps is split into its words
env "${env0[@]}" CUDA_VISIBLE_DEVICES=0 taskset -c "$(list "${cores[@]:0:half}")" bash "$HERE/gpu_session.sh" "$OUT/gpu0" $STEPS0 \
  > "$OUT/gpu0.out" 2>&1 &
# shellcheck disable=SC2086
env "${env1[@]}" CUDA_VISIBLE_DEVICES=1 taskset -c "$(list "${cores[@]:half}")" bash "$HERE/gpu_session.sh" "$OUT/gpu1" $STEPS1 \
  > "$OUT/gpu1.out" 2>&1 &
wait
touch "$OUT/DONE"
