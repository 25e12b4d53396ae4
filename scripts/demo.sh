#!/usr/bin/env bash
# The main job: tune ResNet's last conv layer on this machine with the embedded defaults
# (local RPC tracker and servers, SQLite in farm.db), then print and export the best config.
# On a machine with an NVIDIA GPU it tunes for cuda (300 trials), otherwise for the CPU.
# Extra arguments go to `farm tune`, e.g.  bash scripts/demo.sh --trials 500
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  TARGET=cuda; TRIALS=300
else
  TARGET=llvm; TRIALS=64
fi
exec .venv/bin/farm tune resnet-last-conv --target "$TARGET" --trials "$TRIALS" --export best.json "$@"
