#!/usr/bin/env bash
# bench/gpu_session.sh runs at once on a machine of several GPUs, one per GPU (CUDA_VISIBLE_DEVICES),
# for steps that need one GPU each (check, kernels, fsearch, vsms; not e2e, which takes two):
#   bash bench/gpu_parallel.sh OUTDIR "STEPS ON GPU 0" "STEPS ON GPU 1" [...]
# One run per list of steps, on GPUs 0, 1, ... in order ("" leaves a GPU idle). Each run writes to
# OUTDIR/gpuN with the environment's settings (KERNEL_CASES, VSMS_CASES, ...), and a setting
# prefixed GPUN_ applies to run N alone, over the plain one (GPU1_VSMS_CASES="resnet-last-conv"
# while the others take VSMS_CASES; GPU2_VSMS_SEEDS=1 for a second seed of a case on GPU 2);
# OUTDIR/DONE appears when all have ended, for bench/gpu_collect.sh. GPUN_DEVICES gives run N more
# GPUs than its own (GPU0_DEVICES=0,1 GPU1_DEVICES=2,3: two 2-GPU jobs side by side on 4 GPUs).
# Each run is pinned (taskset) to its own equal share of the cores this script may use, and the
# farm and vs_metaschedule's MetaSchedule size their build pools by the cores they may use
# (farm.core.host): each run is a one-GPU machine of 1/N of the cores. Unpinned, both sized their
# pools by the whole host, and beside a farm job 504 of MetaSchedule's 512 builds outlasted its
# 30 s timeout (docs/benchmarks/kernels-2026-11-26g.md). Their tuning wall times are those of
# such a share of the machine, not of a job alone on the host; the kernels' latencies, timed on
# their own GPUs, are the same.
set -uo pipefail
OUT=${1:?output folder}; shift
(( $# >= 2 )) || { echo "gpu_parallel.sh: give one list of steps per GPU, two or more" >&2; exit 2; }
runs=("$@")
# The cores this script may run on, split into as many equal shares as there are runs.
mapfile -t cores < <(python3 -c "import os; print(*sorted(os.sched_getaffinity(0)), sep='\n')")
share=$(( ${#cores[@]} / ${#runs[@]} ))
if (( share == 0 )) || ! command -v taskset > /dev/null; then
  echo "gpu_parallel.sh: needs taskset and a core per GPU's run or more, to give each run cores of its own" >&2; exit 2
fi
list() { local IFS=,; echo "$*"; }
# Run n's own settings: each GPU<n>_NAME=value of the environment as NAME=value (NUL-separated).
own() { local v; for v in $(compgen -e); do [[ $v == GPU$1_* ]] && printf '%s=%s\0' "${v#GPU"$1"_}" "${!v}"; done; }
mkdir -p "$OUT"; rm -f "$OUT/DONE"
HERE=$(cd "$(dirname "$0")" && pwd)
for n in "${!runs[@]}"; do
  [[ -n ${runs[n]// } ]] || continue
  mapfile -d '' settings < <(own "$n")
  # shellcheck disable=SC2086  # each list of steps is split into its words
  devices=GPU${n}_DEVICES
  env "${settings[@]}" CUDA_VISIBLE_DEVICES="${!devices:-$n}" taskset -c "$(list "${cores[@]:n*share:share}")" \
    bash "$HERE/gpu_session.sh" "$OUT/gpu$n" ${runs[n]} > "$OUT/gpu$n.out" 2>&1 &
done
wait
touch "$OUT/DONE"
