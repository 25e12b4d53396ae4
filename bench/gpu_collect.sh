#!/usr/bin/env bash
# Waits for a background bench/gpu_session.sh (started with setsid on the GPU machine) and
# brings back what it has so far, so one long session can span several device calls:
#   bash bench/gpu_collect.sh SESSION_DIR DEST [WAIT_SECONDS]
# (or bench/gpu_parallel.sh's, whose runs' logs are in SESSION_DIR/gpu0, gpu1, ...).
# Waits until SESSION_DIR/DONE exists or WAIT_SECONDS (default 300: a machine lost during a call
# takes that call's results with it) pass, prints the session
# log's new lines, and packs SESSION_DIR: everything but the stores into DEST/results.tgz, and
# the stores (SQLite, each with its write-ahead log: a job's trials, their errors and timelines)
# gzipped into DEST/stores.tar, smallest first, as many as fit STORES_MIB (default 15) in all,
# naming those left out. The device tool brings back no file over 16 MiB, and one archive of a
# four-GPU session's stores was over that, so the whole call came back empty. Exit 0 when the
# session is done, 3 while it still runs.
set -uo pipefail
DIR=${1:?session folder}; DEST=${2:?destination}; WAIT=${3:-300}
for _ in $(seq "$WAIT"); do [[ -f $DIR/DONE ]] && break; sleep 1; done
grep -h "^== \|WARNING\|seed [0-9]*: best\|random.s best, median\|^  random:\|relative L2\|median best\|^MetaSchedule\|^ *farm:\|^metaschedule:\|of best\|^farm tune: \|^ms.tune_tir: \|best after\|zero-shot\|/ tuned\|GPU(s)\|scaling\|warm farm\|Traceback\|Error\|PyTorch \|best measured\|candidates in\|wrong result\|fastest" \
  "$DIR"/*.log "$DIR"/gpu[0-9]/*.log 2>/dev/null | tail -n 60
# torch.compile's caches (bench/models_vs_torch.py's) are tens of MiB of compiled kernels: left out too.
tar -C "$DIR" --exclude='*.db' --exclude='*.db-wal' --exclude='*.db-shm' --exclude=inductor-cache \
  --exclude=triton-cache -czf "$DEST/results.tgz" .
stage=$(mktemp -d); budget=$(( ${STORES_MIB:-15} * 1024 * 1024 )); total=0; left=()
while IFS= read -r -d '' db; do
  rel=${db#"$DIR"/}; files=("$rel"); [[ -f $db-wal ]] && files+=("$rel-wal")
  size=0
  for f in "${files[@]}"; do
    mkdir -p "$stage/$(dirname "$f")"; gzip -c "$DIR/$f" > "$stage/$f.gz"; size=$(( size + $(stat -c %s "$stage/$f.gz") ))
  done
  if (( total + size > budget )); then
    for f in "${files[@]}"; do rm -f "$stage/$f.gz"; done; left+=("$rel")
  else
    total=$(( total + size ))
  fi
done < <(find "$DIR" -name '*.db' -printf '%s %p\0' | sort -zn | cut -zd' ' -f2-)
tar -C "$stage" -cf "$DEST/stores.tar" .; rm -rf "$stage"
(( ${#left[@]} )) && echo "stores left out (over ${STORES_MIB:-15} MiB gzipped in all): ${left[*]}"
[[ -f $DIR/DONE ]] && exit 0 || exit 3
