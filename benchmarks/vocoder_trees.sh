#!/usr/bin/env bash
# The vocoder-alone table of code2wav_pipeline_bench.py (16 streams, one steady 1-s chunk each: per stream eager,
# per stream graphed, batched eager, batched graphed) for several source trees, alternating, REPS times. Each tree
# is a folder holding src/, tests/ and benchmarks/ (`mkdir T && git archive <commit> src tests benchmarks | tar -x
# -C T`; "." is this one). Prints each run's rows; the JSON/Markdown of each run go to $W (not brought back).
#   REPS=2 bash benchmarks/vocoder_trees.sh . _t_c6b81a1 _t_f6a571e
set -uo pipefail
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc}
W=${W:-/tmp/vocoder_trees}
[ $# -gt 0 ] || { echo "vocoder_trees.sh: name at least one tree folder ('.' for this one)" >&2; exit 2; }
if [ -d _wheels ]; then python -m pip install -q --no-deps _wheels/*.whl || exit 1; fi
if [ -d _shared/minicpmo45 ] && [ ! -d ../shared/minicpmo45 ]; then mkdir -p ../shared && cp -r _shared/minicpmo45 ../shared/; fi
for rep in $(seq 1 "${REPS:-2}"); do
  for t in "$@"; do
    [ -f "$t/benchmarks/code2wav_pipeline_bench.py" ] || { echo "vocoder_trees.sh: $t has no benchmarks/" >&2; exit 2; }
    name=$(basename "$(cd "$t" && pwd)")
    (cd "$t" && PYTHONPATH=$PWD/src:$PWD/tests:$PWD/benchmarks timeout 150 python benchmarks/code2wav_pipeline_bench.py \
       --out "$W/${name}_$rep" --paths no_flow_rows --streams 16 2>&1 | grep -E "'mode'|Error" | cut -c1-400)
    echo "== $name rep $rep"
  done
done
