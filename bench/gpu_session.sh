#!/usr/bin/env bash
# The GPU measurements, run on a lent H100/H200 after the device bundles are staged
# (../shared/device/README.md). Steps (default: the first four, in this order):
#   torch       PyTorch/cuDNN latency of every preset (bench/torch_baseline.py)
#   smoke       a 24-trial cuda job on a small matmul: the cuda path works end to end
#   throughput  farm runner vs stock MetaSchedule RPCRunner on 32 resnet-last-conv candidates
#   tune        a TRIALS-trial cuda tuning job of resnet-last-conv, exported
#   vsms        farm xgb (one GPU) vs stock ms.tune_tir, MS_TRIALS each, per seed of VSMS_SEEDS (default 0),
#               per case of VSMS_CASES (;-separated, default resnet-last-conv) into OUTDIR/vsms-CASE
#               (bench/vs_metaschedule.py; about 405 s per seed for ms.tune_tir at 256 trials on an H200 host)
#   search      xgb vs random search, trials to 95% of the best (bench/costmodel_search.py)
#   zeroshot    farm predict on held-out conv2d shapes vs tuning them (bench/costmodel_zeroshot.py)
#   fsearch     bench/farm_search.py through `farm tune`, per FSEARCH_CASES (;-separated, default
#               resnet-last-conv; matmul 1024^3; conv2d 1x256x14x14 3x3): FSEARCH_SEEDS (3) runs of FSEARCH_TRIALS (171: a
#               third of random's) of each search spec of FSEARCH_SEARCHES (space-separated, default xgb;
#               "xgb xgb:screen=16" compares two settings) against FSEARCH_RANDOM_SEEDS (3) random searches
#               of FSEARCH_RANDOM (512); FSEARCH_FIRST_SEED (0) shifts their seeds, for a case spread over GPUs
#   fsearchwarm fsearch of FSEARCH_WARM_CASES (;-separated) into OUTDIR/fsearchwarm-CASE, each xgb run
#               starting from a copy of the store FSEARCH_HISTORY (default: the first xgb run's store of
#               the fsearch step's first case in OUTDIR, so "fsearch fsearchwarm" runs one after the
#               other): a job on a farm that tuned other shapes of the family before (--history)
#   contention  bench/build_contention.py on cuda: a CONTENTION_TRIALS-trial (128) random job of
#               CONTENTION_CASE (default resnet-last-conv), seeds CONTENTION_SEEDS (0), its latencies against
#               the same configs measured again with nothing building
#   retime      VSMS_DIR's two best kernels (an earlier vsms step) checked and timed again
#   e2e         bench/e2e_throughput.py: E2E_TRIALS trials of resnet-last-conv on E2E_GPUS GPUs,
#               the seeds E2E_SEEDS ("0 1 2"), busy share, scaling, first trial; timeline PNGs
#   warm        bench/e2e_throughput.py --warm-submit: farm submit to a running farm -> first trial
#   maxpool     bench/e2e_throughput.py on max pool 64x64x112x112 3x3 s2: 64 trials, 1 GPU, the seeds
#               E2E_SEEDS, each timed as a whole, with its per-candidate overhead and timeline
#   startup     bench/startup_parts.py: a farm tune's start-up steps, each in fresh processes
#   firstbuilds bench/first_builds.py on cuda, one build slot per core: how long the slots take to
#               be warm, and the build seconds and statuses of a 2-GPU job's first batches
#   check       bench/check_templates_gpu.py: every cuda template's random sample run against NumPy
#               (CHECK_TARGET, default cuda; '{"kind":"cuda","arch":"sm_90a"}' puts fp16 matmuls on wgmma;
#               CHECK_CASES, ;-separated: only those cases)
#   fused       bench/fused_vs_torch.py per case of FUSED_CASES (space-separated, default "conv dense"):
#               FUSED_SEEDS ("0 1 2") jobs of FUSED_TRIALS (256) trials with --templates all, each template's
#               best kernel against PyTorch eager and torch.compile (OUTDIR/fused-CASE.json)
#   models      bench/models_vs_torch.py per case of MODELS_CASES (space-separated, default "resnet50 bert"):
#               at each batch of MODELS_BATCHES ("1 16") and seed of MODELS_SEEDS ("0 1 2"), farm tune-model of
#               MODELS_TRIALS (2000) trials on MODELS_GPUS (1) GPUs, timed whole, then the tuned model against
#               PyTorch eager, torch.compile and TVM's untuned build (OUTDIR/models-CASE.json, files in
#               OUTDIR/models); MODELS_OPTIONS adds options ("--max-autotune --ms-tune-relax"); each case's
#               limit is MODELS_LIMIT seconds (14400)
#   kernels     bench/kernels_vs_vendor.py: KERNEL_CASES (;-separated) tuned KERNEL_TRIALS trials,
#               KERNEL_SEEDS seeds each, best kernels re-timed side by side with PyTorch; one run per
#               case (OUTDIR/kernels-CASE.json), so a case's figures stand whatever the next one does;
#               KERNEL_TARGET (default cuda) is farm tune's --target for kernels and rekernels
#   rekernels   bench/kernels_vs_vendor.py --retime --allow-stale: KERNEL_CASES' exports of an earlier run
#               in KERNELS_DIR (seeds 0 .. KERNEL_SEEDS-1) rebuilt by the current templates and timed again,
#               with KERNEL_CONFIGS (;-separated LABEL=JSON, one case only) timed beside them
#   ncu         Nsight Compute on NCU_CASE's seed-0 export in KERNELS_DIR and on PyTorch's kernel for it:
#               the first NCU_LAUNCHES kernels of a retime (PyTorch's reference, then the farm's kernel,
#               then each of KERNEL_CONFIGS' kernels, each launched once to check it), or with NCU_KERNEL
#               the first NCU_LAUNCHES whose name matches that regex (TVM names the farm's kernels
#               main_kernel*: cuDNN's layout transposes come before them otherwise);
#               NCU_TARGET (default KERNEL_TARGET) is the export's target
#   bash bench/gpu_session.sh OUTDIR [STEP ...]      (TRIALS=300, MS_TRIALS=128 by default)
# OUTDIR/DONE appears when every step has ended (for a session run in the background and
# collected by bench/gpu_collect.sh).
set -uo pipefail
OUT=${1:?output folder}; shift
STEPS=${*:-torch smoke throughput tune}
TRIALS=${TRIALS:-300}
MS_TRIALS=${MS_TRIALS:-128}; VSMS_SEEDS=${VSMS_SEEDS:-0}; VSMS_CASES=${VSMS_CASES:-resnet-last-conv}
KERNEL_CASES=${KERNEL_CASES:-resnet-last-conv;matmul M=1024 N=1024 K=1024}
KERNEL_TRIALS=${KERNEL_TRIALS:-512}; KERNEL_SEEDS=${KERNEL_SEEDS:-3}
FSEARCH_CASES=${FSEARCH_CASES:-resnet-last-conv;matmul M=1024 N=1024 K=1024;conv2d_nchw N=1 CI=256 H=14 W=14 CO=256 KH=3 KW=3 pad=1}
FSEARCH_TRIALS=${FSEARCH_TRIALS:-171}; FSEARCH_RANDOM=${FSEARCH_RANDOM:-512}; FSEARCH_RANDOM_SEEDS=${FSEARCH_RANDOM_SEEDS:-3}
FSEARCH_SEEDS=${FSEARCH_SEEDS:-3}
FSEARCH_SEARCHES=${FSEARCH_SEARCHES:-xgb}
E2E_TRIALS=${E2E_TRIALS:-500}; E2E_GPUS=${E2E_GPUS:-1 2}; E2E_SEEDS=${E2E_SEEDS:-0 1 2}
mkdir -p "$OUT"; rm -f "$OUT/DONE"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/gpu.txt"
nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | sed "s/^/driver: /" \
  | tee -a "$OUT/gpu.txt"
# The host's CPUs and the ones this session may use: whether a share of them is physical cores or
# hyperthreads decides how fast builds go beside other runs (bench/gpu_parallel.sh).
lscpu 2>/dev/null | grep -E "^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\))" \
  | tee -a "$OUT/gpu.txt"
echo "this session's cores: $(taskset -pc $$ 2>/dev/null | cut -d: -f2)" | tee -a "$OUT/gpu.txt"
# The device bundles are staged without bytecode (../shared/device/make-bundles.sh: no
# __pycache__, pip --no-compile). Compile it once, as `pip install` does on a real install, so that
# no measured process compiles TVM's or Ray's sources on import (startup_parts: TVM's import and
# the task's space took 6.4 s there, 0.8 s on a CPU machine with bytecode).
python3 -c "import sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode)" | tee -a "$OUT/gpu.txt"
t0=$SECONDS; python3 -m compileall -q -j 0 ${PYTHONPATH//:/ } > /dev/null 2>&1
echo "bytecode compiled in $((SECONDS - t0)) s" | tee -a "$OUT/gpu.txt"
# KERNEL_CONFIGS as kernels_vs_vendor.py options (rekernels, ncu).
configs=()
if [ -n "${KERNEL_CONFIGS:-}" ]; then
  IFS=';' read -ra given <<< "$KERNEL_CONFIGS"
  for config in "${given[@]}"; do configs+=("--config=$config"); done
fi
# A case's name in file names: "matmul M=64 N=64" -> "matmul-M64-N64".
case_name() { tr -d '=' <<< "$1" | tr ' /' '--'; }
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1; echo "== $name: exit $? in $((SECONDS - t0)) s"; }
# bench/farm_search.py per case of CASES (;-separated) as step PREFIX-CASE, with farm_search's OPTIONS.
fsearch() { local prefix=$1 list=$2 cases case name words searches; shift 2
  IFS=';' read -ra cases <<< "$list"; read -ra searches <<< "$FSEARCH_SEARCHES"
  for case in "${cases[@]}"; do
    name=$(case_name "$case"); read -ra words <<< "$case"
    # Its limit: about 150 s per 512-trial random run and 70 s per 171-trial guided run on an H100, doubled.
    step "$prefix-$name" $((300 * FSEARCH_RANDOM_SEEDS * FSEARCH_RANDOM / 512 + 140 * FSEARCH_SEEDS * ${#searches[@]} * FSEARCH_TRIALS / 171 + 300)) python3 bench/farm_search.py --workload "${words[0]}" \
      --params "${words[@]:1}" --target cuda --search "${searches[@]}" --seeds "$FSEARCH_SEEDS" --trials "$FSEARCH_TRIALS" --random-trials "$FSEARCH_RANDOM" --random-seeds "$FSEARCH_RANDOM_SEEDS" --first-seed "${FSEARCH_FIRST_SEED:-0}" \
      --out "$OUT/$prefix-$name" --json "$OUT/$prefix-$name.json" "$@"
  done; }
for s in $STEPS; do
  case $s in
    torch) step torch 120 python3 bench/torch_baseline.py --json "$OUT/torch.json" ;;
    smoke) step smoke 240 python3 -m farm tune matmul M=256 N=256 K=256 --target cuda --trials 24 \
             --db "sqlite:///$OUT/smoke.db" --log-dir "$OUT/logs-smoke" ;;
    throughput) step throughput 400 python3 bench/measure_throughput.py --target cuda \
             --preset resnet-last-conv --candidates 32 --json "$OUT/throughput.json" ;;
    tune) step tune 560 python3 -m farm tune resnet-last-conv --target cuda --trials "$TRIALS" \
             --db "sqlite:///$OUT/farm.db" --export "$OUT/best.json" --log-dir "$OUT/logs" ;;
    vsms) IFS=';' read -ra cases <<< "$VSMS_CASES"
          for case in "${cases[@]}"; do
            name=$(case_name "$case"); read -ra words <<< "$case"
            step "vsms-$name" 3000 python3 bench/vs_metaschedule.py --workload "${words[0]}" --params "${words[@]:1}" \
              --target cuda --trials "$MS_TRIALS" --seeds $VSMS_SEEDS --out "$OUT/vsms-$name" --json "$OUT/vsms-$name.json"
          done ;;
    search) step search 1500 python3 bench/costmodel_search.py --target cuda --budget 64 --seeds 2 \
             --random 128 --out "$OUT/search" --json "$OUT/search.json" ;;
    zeroshot) step zeroshot 1200 python3 bench/costmodel_zeroshot.py --target cuda --families conv2d \
             --out "$OUT/zeroshot" --json "$OUT/zeroshot.json" ;;
    fsearch) fsearch fsearch "$FSEARCH_CASES" ;;
    fsearchwarm) IFS=';' read -ra first <<< "$FSEARCH_CASES"
                 fsearch fsearchwarm "${FSEARCH_WARM_CASES:?}" \
                   --history "${FSEARCH_HISTORY:-$OUT/fsearch-$(case_name "${first[0]}")/xgb-0.db}" ;;
    contention) for seed in ${CONTENTION_SEEDS:-0}; do
                  read -ra words <<< "${CONTENTION_CASE:-resnet-last-conv}"
                  step "contention-seed$seed" 900 python3 bench/build_contention.py --workload "${words[0]}" \
                    --params "${words[@]:1}" --target cuda --trials "${CONTENTION_TRIALS:-128}" --seed "$seed" \
                    --out "$OUT/contention" --json "$OUT/contention-seed$seed.json"
                done ;;
    retime) step retime 300 python3 bench/vs_metaschedule.py --target cuda --out "${VSMS_DIR:?}" --retime ;;
    e2e) step e2e 3000 python3 bench/e2e_throughput.py --target cuda --trials "$E2E_TRIALS" --gpus $E2E_GPUS \
             --seeds $E2E_SEEDS --out "$OUT/e2e" --json "$OUT/e2e.json" ;;
    warm) step warm 600 python3 bench/e2e_throughput.py --target cuda --seeds --warm-submit \
             --out "$OUT/warm" --json "$OUT/warm.json" ;;
    maxpool) step maxpool 900 python3 bench/e2e_throughput.py --target cuda --workload pool2d \
               --params N=64 C=64 H=112 W=112 KH=3 KW=3 stride=2 pad=1 kind=max --trials 64 --gpus 1 \
               --seeds $E2E_SEEDS --out "$OUT/maxpool" --json "$OUT/maxpool.json" ;;
    firstbuilds) step firstbuilds 300 python3 bench/first_builds.py --target cuda --seeds 1 \
                   --json "$OUT/firstbuilds.json" ;;
    startup) step startup 300 python3 bench/startup_parts.py --repeats "${STARTUP_REPEATS:-3}" --json "$OUT/startup.json" ;;
    check) checks=()
           if [ -n "${CHECK_CASES:-}" ]; then
             IFS=';' read -ra cases <<< "$CHECK_CASES"
             for case in "${cases[@]}"; do checks+=("--case=$case"); done
           fi
           step check 600 python3 bench/check_templates_gpu.py --trials-per-case "${CHECK_TRIALS:-32}" \
             --target "${CHECK_TARGET:-cuda}" "${checks[@]}" --out "$OUT/check" ;;
    fused) for case in ${FUSED_CASES:-conv dense}; do
             step "fused-$case" 3000 python3 bench/fused_vs_torch.py --case "$case" --trials "${FUSED_TRIALS:-256}" \
               --seeds ${FUSED_SEEDS:-0 1 2} --out "$OUT/fused" --json "$OUT/fused-$case.json"
           done ;;
    models) for case in ${MODELS_CASES:-resnet50 bert}; do
              step "models-$case" "${MODELS_LIMIT:-14400}" python3 bench/models_vs_torch.py --case "$case" \
                --batch ${MODELS_BATCHES:-1 16} --seeds ${MODELS_SEEDS:-0 1 2} --trials "${MODELS_TRIALS:-2000}" \
                --gpus "${MODELS_GPUS:-1}" ${MODELS_OPTIONS:-} --out "$OUT/models" --json "$OUT/models-$case.json"
            done ;;
    kernels) IFS=';' read -ra cases <<< "$KERNEL_CASES"
             for case in "${cases[@]}"; do
               name=$(case_name "$case")
               step "kernels-$name" 3000 python3 bench/kernels_vs_vendor.py --case="$case" --trials "$KERNEL_TRIALS" \
                 --seeds "$KERNEL_SEEDS" --target "${KERNEL_TARGET:-cuda}" --out "$OUT/kernels" --json "$OUT/kernels-$name.json"
             done ;;
    rekernels) IFS=';' read -ra cases <<< "$KERNEL_CASES"
             for case in "${cases[@]}"; do
               name=$(case_name "$case")
               step "rekernels-$name" 600 python3 bench/kernels_vs_vendor.py --case="$case" --seeds "$KERNEL_SEEDS" \
                 --target "${KERNEL_TARGET:-cuda}" --retime --allow-stale --out "${KERNELS_DIR:?}" "${configs[@]}" \
                 --json "$OUT/rekernels-$name.json"
             done ;;
    ncu) name=$(case_name "${NCU_CASE:?}")
         only=(); [ -n "${NCU_KERNEL:-}" ] && only=(--kernel-name "regex:$NCU_KERNEL")
         # --clock-control none: the clocks as the timed runs see them (the device tool's METHOD.md).
         # The report is kept (OUTDIR/ncu-CASE.ncu-rep): its details are printed into the step's log,
         # and its SASS with each instruction's samples and counts (the source page, which the
         # SourceCounters section's summary leaves out) into OUTDIR/ncu-CASE-sass.csv.
         step "ncu-run-$name" 600 ncu --clock-control none "${only[@]}" --launch-count "${NCU_LAUNCHES:-6}" --section SpeedOfLight \
           --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
           --section WarpStateStats --section SchedulerStats --section SourceCounters -f -o "$OUT/ncu-$name" \
           python3 bench/kernels_vs_vendor.py --case="$NCU_CASE" \
           --seeds 1 --target "${NCU_TARGET:-${KERNEL_TARGET:-cuda}}" --retime --allow-stale --out "${KERNELS_DIR:?}" \
           "${configs[@]}"
         step "ncu-$name" 120 ncu -i "$OUT/ncu-$name.ncu-rep" --page details
         ncu -i "$OUT/ncu-$name.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu-$name-sass.csv" 2>&1 ;;
    *) echo "unknown step $s" >&2 ;;
  esac
done
touch "$OUT/DONE"
