#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/*_h200.*: CUDA tests, then the benchmarks, each
# writing under $OUT (the device tool's output folder; any folder works elsewhere).
#   bash benchmarks/run_h200.sh tests|features|code2wav|all
# Needs python3 with torch + triton (+ av and soundfile for the features benchmark).
set -o pipefail
OUT=${OUT:-/tmp/minicpmo_rt_h200}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests:${PYTHONPATH:-}
mkdir -p "$OUT"
part=${1:-all}

if [[ $part == tests || $part == all ]]; then
  # two runs with their own limits: one 300-s run over both sets stopped inside the thinker tests
  for set in code2wav thinker; do
    if [[ $set == code2wav ]]; then
      files="tests/code2wav/test_fused_dit.py tests/code2wav/test_tiled_attention.py tests/code2wav/test_small_gemm.py
        tests/code2wav/test_euler_graph.py tests/code2wav/test_hift_graph.py tests/code2wav/test_pipeline_batched.py
        tests/code2wav/test_vocoder_batched.py tests/code2wav/test_slot_pool.py tests/code2wav/test_precision.py
        tests/code2wav/test_hift_fast.py tests/code2wav/test_hift_snake_kernel.py"
    else
      files="tests/thinker/test_llm_cache.py tests/thinker/test_session.py tests/thinker/test_decode.py
        tests/thinker/test_kernels.py tests/thinker/test_audio_forks.py tests/thinker/test_staging.py
        tests/thinker/test_mel.py tests/thinker/test_audio.py tests/features/test_extract_logic.py"
    fi
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -s $files 2>&1 | grep -vE "^(tests/|\s*$)" \
      | tee "$OUT/cuda_tests_$set.txt" | grep -E "rel err|passed|failed|FAIL|Error" | tail -40
  done
fi
if [[ $part == features || $part == all ]]; then
  timeout 420 python3 benchmarks/features_bench.py /tmp/fb 2>&1 | grep -vE "^\s+(boundary|clean|future|snapshot)" | tail -25
  mkdir -p "$OUT/f" && cp /tmp/fb/features_bench.{json,md} "$OUT/f/"
fi
if [[ $part == code2wav || $part == all ]]; then
  timeout 150 python3 benchmarks/code2wav_kernels_bench.py --out "$OUT/k" --quick --skip gemm 2>&1 | grep -E "solve|attn R|done" 
  timeout 200 python3 benchmarks/dit_block_profile.py "$OUT/b" 2>&1 | grep -E "block_us|phase_sum|error" 
  timeout 240 python3 benchmarks/code2wav_bench.py --out "$OUT/c" --batches 1,16,4,8 --budget 0.3 \
    --upstream .upstream_ref 2>&1 | grep -vE "^\|" | tail -30
  timeout 200 python3 benchmarks/code2wav_pipeline_bench.py --out "$OUT/p" 2>&1 | tail -30
  timeout 120 python3 benchmarks/hift_profile.py "$OUT/h" 2>&1 | grep -v "^|" | tail -12
fi
ls -R "$OUT"
