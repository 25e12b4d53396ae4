#!/usr/bin/env bash
# Two bench/gpu_session.sh runs at once on a 2-GPU machine, one per GPU (CUDA_VISIBLE_DEVICES),
# for steps that need one GPU each (check, kernels, fsearch, vsms; not e2e, which takes both):
#   bash bench/gpu_parallel.sh OUTDIR "STEPS ON GPU 0" "STEPS ON GPU 1"
# Each run writes to OUTDIR/gpu0 or OUTDIR/gpu1 with the environment's settings (KERNEL_CASES,
# VSMS_CASES, ...); OUTDIR/DONE appears when both have ended, for bench/gpu_collect.sh. The two
# share the host's cores: their tuning jobs' wall times are not those of a job alone, while the
# kernels' latencies, timed on their own GPUs, are. Not vsms: beside another tuning job,
# MetaSchedule's builds outlast its 30 s build timeout (504 of 512 failed once), so it runs alone.
set -uo pipefail
OUT=${1:?output folder}; STEPS0=${2:?steps for GPU 0}; STEPS1=${3:?steps for GPU 1}
if [[ " $STEPS0 $STEPS1 " == *" vsms "* ]]; then
  echo "gpu_parallel.sh: run vsms alone (bench/gpu_session.sh): beside another job its builds time out" >&2; exit 2
fi
mkdir -p "$OUT"; rm -f "$OUT/DONE"
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck disable=SC2086  # each list of steps is split into its words
CUDA_VISIBLE_DEVICES=0 bash "$HERE/gpu_session.sh" "$OUT/gpu0" $STEPS0 > "$OUT/gpu0.out" 2>&1 &
# shellcheck disable=SC2086
CUDA_VISIBLE_DEVICES=1 bash "$HERE/gpu_session.sh" "$OUT/gpu1" $STEPS1 > "$OUT/gpu1.out" 2>&1 &
wait
touch "$OUT/DONE"
