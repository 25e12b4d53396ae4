#!/usr/bin/env bash
# Waits for a background bench/gpu_session.sh (started with setsid on the GPU machine) and
# brings back what it has so far, so one long session can span several device calls:
#   bash bench/gpu_collect.sh SESSION_DIR DEST [WAIT_SECONDS]
# (or bench/gpu_parallel.sh's, whose runs' logs are in SESSION_DIR/gpu0, gpu1, ...).
# Waits until SESSION_DIR/DONE exists or WAIT_SECONDS (default 540) pass, prints the session
# log's new lines, and packs SESSION_DIR (logs and databases up to 8 MB included: a job's trials,
# their errors and timelines are in its database) into DEST/results.tgz. Exit 0 when the session
# is done, 3 while it still runs.
set -uo pipefail
DIR=${1:?session folder}; DEST=${2:?destination}; WAIT=${3:-540}
for _ in $(seq "$WAIT"); do [[ -f $DIR/DONE ]] && break; sleep 1; done
grep -h "^== \|WARNING\|seed [0-9]*: best\|random.s best, median\|^  random:\|relative L2\|median best\|^MetaSchedule\|^ *farm:\|^metaschedule:\|of best\|best after\|zero-shot\|/ tuned\|GPU(s)\|scaling\|warm farm\|Traceback\|Error\|PyTorch \|best measured\|candidates in\|wrong result\|fastest" \
  "$DIR"/*.log "$DIR"/gpu[0-9]/*.log 2>/dev/null | tail -n 60
tar -C "$DIR" -X <(cd "$DIR" && find . -name '*.db*' -size +8M) -czf "$DEST/results.tgz" .
[[ -f $DIR/DONE ]] && exit 0 || exit 3
