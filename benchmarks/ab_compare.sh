#!/usr/bin/env bash
# Before/after on one GPU machine: the Code2Wav solve rows (B=16, 8: default and slot pool) and the
# 16-stream pipeline, from a baseline source tree and from this tree, alternating
# (baseline solve, new solve, new pipeline, baseline pipeline) so drift does not favour one side.
#   git archive <commit> src | tar -x -C baseline_src     # an untracked copy travels with the tree
#   OUT=DIR bash benchmarks/ab_compare.sh baseline_src/src
set -o pipefail
export PYTHONUNBUFFERED=1
OLD=$(cd "${1:?baseline src folder}" && pwd) NEW=$PWD/src OUT=${OUT:-/tmp/ab}
bench() {  # $1 tag, $2 src
  PYTHONPATH=$2:$PWD/tests timeout 240 python benchmarks/code2wav_bench.py --out "$OUT/bench_$1" --batches 16,8 \
    --only graphs,slot --rows "=fused + graph TF32 on" --budget 0.3 2>&1 | grep -E "B=|peak|fail"
}
pipe() {
  PYTHONPATH=$2:$PWD/tests timeout 240 python benchmarks/code2wav_pipeline_bench.py --out "$OUT/pipe_$1" \
    --paths "fast path" --skip-vocoder --reps 6 2>&1 | grep -vE "^\|" | tail -12
}
echo "== bench old"; bench old "$OLD"
echo "== bench new"; bench new "$NEW"
echo "== pipe new"; pipe new "$NEW"
echo "== pipe old"; pipe old "$OLD"
