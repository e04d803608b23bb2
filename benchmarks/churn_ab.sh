#!/usr/bin/env bash
# Before/after of whole serving rounds (stream_churn_bench.py, the default variant only) on one GPU
# machine: a warm-up run of this tree (compiles Triton kernels into the shared cache), then baseline and
# this tree alternating PAIRS times (default 3) so drift does not favour one side; SLOTS request slots (default 16),
# CHURN_ARGS more options of stream_churn_bench.py (e.g. "--final-codes 1,25").
# Then the table:
#   git archive <commit> src | tar -x -C _base      # an untracked copy travels with the tree
#   OUT=DIR bash benchmarks/churn_ab.sh _base/src
#   python benchmarks/churn_ab_table.py DIR --out benchmarks/results/NAME   # writes NAME.json and NAME.md
set -o pipefail
export PYTHONUNBUFFERED=1
OLD=$(cd "${1:?baseline src folder}" && pwd) NEW=$PWD/src OUT=${OUT:-/tmp/churn_ab}
mkdir -p "$OUT"
i=0
order="warm"
for _ in $(seq "${PAIRS:-3}"); do order="$order base new"; done
for v in $order; do
  i=$((i+1))
  if [ $v = base ]; then P=$OLD; else P=$NEW; fi
  # shellcheck disable=SC2086  # CHURN_ARGS: more stream_churn_bench.py options, word-split on purpose
  PYTHONPATH=$P:$PWD/tests timeout 150 python benchmarks/stream_churn_bench.py --only "(default)" --no-slot-pool ${CHURN_ARGS:-} \
    --slots "${SLOTS:-16}" --runs 2 --out "$OUT/run_${i}_$v" 2>&1 | grep -E "^\+ |Error" | sed "s/^/$i $v: /"
done
