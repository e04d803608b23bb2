#!/usr/bin/env bash
# Set up (if needed), write the tiny checkpoint and run the main job on it.
# The tiny checkpoint has RANDOM weights: its audio is noise and its text gibberish.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${DEMO_OUT:-demo_out}
mkdir -p "$OUT"
rm -rf "$OUT/tiny"
minicpmo-rt make-tiny "$OUT/tiny" --seed 0
minicpmo-rt inspect --model "$OUT/tiny"
