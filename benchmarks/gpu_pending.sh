#!/usr/bin/env bash
# The GPU runs a session left pending, as steps of device calls. A call may last 10 minutes and each step has
# its own cap (the timeouts below), so group them by priority into calls of under 10 minutes each. Session 31
# ran `jtests tests`, `starts carry`, `prepare`, `churn stage`; session 32 `tests`, `ab`, then (final chunks'
# encoder calls padded, encode_ends) `ftests`, `ab` with CHURN_ARGS="--final-codes 1,25" against bbf0517, and
# `tests ab` (same CHURN_ARGS) against a89fbdd; session 33 `tests ftests`, then `ab` with
# CHURN_ARGS="--final-codes 1,25" against 5032778 (every short excitation block padded, wide finals in CFM query
# bucket 56); session 34 `ptests pool` (the slot pool's finals joining its solve: its 4 CUDA tests pass, its
# rounds take 1.35x less time than the default's, nothing captured mid-serving), `table`; session 35 `all` (the
# whole suite on the GPU: 1740 passed after two CPU tests learned to expect a GPU); session 36 `profile`, then two
# switch probes of experiments reverted since (1607bd6: `solve_switch_probe.py --trim --called` of
# kernels.dit_ops.ATTN_PREFETCH and euler_graph.COPY_ENGINE_SUCCESSORS), and one of an uncommitted edit
# (FusedDiT.wide_fc2_splits 1,2,4) and one of another (kernels.tiled_attention.PV_TRANSPOSED 0,1). Session 45
# left `dtests duplex` pending (the duplex Talker's fused draw forward, default on CUDA since then: its CUDA run was
# cut off at the call's limit inside test_duplex.py, and the duplex bench was not rerun); session 46 ran them (82
# passed) and leaves `commits` pending (an A/B of commit_many in both orders, with device time to spare); session
# 47 ran `dtests` (82 passed) and `commits` (commit_many 1.16-1.29x per second), then the Talker's device draws and
# prefill graphs against the tree before them (talker_device_draws_session47_h200.md); it leaves `dtests` pending for
# its review commits (1a667a7: TalkerTurns' attributes and docstrings; 7df944f: draw_rows), which session 48 ran
# (84 passed, 2 skipped: talker_duplex_turn_cuda_tests_session48_h200.txt). Session 49 leaves `admit` pending: where a
# 16-request admission's host->device move of the hidden rows stalls (3-91 ms in some runs,
# talker_prefill_session49_h200.md section 5), with the rows handed over as now, pinned, and on the device. Session 50
# ran it, then `admitab` (the rows on the device, the projector padded; talker_admit_session50_h200.md) and `dtests`
# (93 passed, 2 skipped: talker_duplex_turn_cuda_tests_session50_h200.txt), and `duplexab` (the same change in duplex
# mode, 1.3-1.9% slower there, so reverted; section 6 of that report), then `mtests melab` and `melab1` (the commits'
# mels in one batch: the mel 2.5x faster, the second not, so opt-in; duplex_mel_batch_session50_h200.md). Session 51
# ran `all` (1917 passed at 833781f: cuda_tests_all_session51_h200.txt), `melnf` and `melf` (the batched mel waited for
# the vision encoder behind a pageable copy, fixed; duplex_mel_batch_session51_h200.md), and leaves `qwait` pending:
# the CUDA tests of the staged uploads (audio steps, forks, prefill_at, the Talker's admission and turns: written then,
# not yet run on a GPU) and the probe of which duplex stages still wait for queued work; then A/Bs of those changes
# against the tree before them (`git archive 833781f src`): `duplexab` (the duplex second) and `admitab` (the turn's
# admission and first audio). Session 52 ran `qwait` (26 passed; the batched mel still waited, for cuFFT plans that
# warm_stft_plans had warmed a frame off each bucket: fixed, duplex_waits_session52_h200.md), `melf` and `duplexab`
# (1.008x, level), and leaves `stests` (its last CUDA test edits: the plan cache, the ring's reserve), `wtests` and
# `warm20` (the duplex warm-up precapturing the Talker's prefill graphs at every attention bucket: found on the CPU
# to be what made second 8 of every run slow, not yet measured) and `admitab` (against 833781f) pending. Session
# 53 ran them (all pass; second 8 flat; admission level), then `htests`, `warm20` and `holdab` (HostStaging.hold:
# no slot grown at seconds 16-18, 1.006x) and `UNITS=7 warm20` with the capture/compile census; it leaves the slow
# seconds 1 and 4 after a warm-up unexplained (duplex_waits_session53_h200.md section 5). Its last run, `parts7`,
# found second 4's: the mel took 34 ms against ~12 at the stream's first dynamic floor (5 s of buffer), whose
# kernels no warm-up had launched; mel.warm_mel now runs both floors at start-up. Pending: `mtests` (its CUDA
# test, test_cuda_warm_mel_launches_every_kernel_a_streaming_mel_launches) and `parts7` / `UNITS=7 warm20`
# (second 4 should be flat; second 1 is still unexplained: the rows now record each second's Thinker tokens).
# Session 54 ran `parts7 mtests` (second 4 flat; the mel test failed on cuBLAS's shape-picked GEMM kernels, fixed
# by running the mel at the bucket's width), the mel's CUDA tests with `UNITS=7 warm20` (pass; flat), and `alloc`
# (second 2's 8000 MiB: the Code2Wav streams' first steady caches; duplex_waits_session54_h200.md). Its last two
# mel edits ran on no GPU (the device was not lent again): warm_mel's plans from its own log_mel calls with the
# no-new-plan check, and _warmed_rows running the batched mel at every bucket. Pending: `mtests` (test_mel.py's
# test_cuda_warm_mel_launches_every_kernel_a_streaming_mel_launches and
# test_cuda_batched_mel_launches_no_kernel_and_makes_no_plan_after_its_first_batch).
# Session 55 (no device lent) added `serve`: the HTTP server's tests on the GPU and serve_bench.py (streamed HTTP
# answers against direct pipeline calls, N = 1, 8, 16). Pending: `mtests`, `serve`, `all`.
# Session 57 added the Talker's lead (a joiner thinks while the speakers are ahead of real time) and playback
# stalls to serve_bench: steps `lead` and `lead50`.
# Session 56 added mid-batch admission to the server and a staggered-arrival run to `serve`, then was lent the
# device: it ran `all` (every CUDA test passed; the only failures need PyAV, which the image lacks), `stagger`,
# `sbench` (which found the listen backlog of 5, fixed), `stagger50` and again `sbench stagger50`
# (serve_session56_h200.md). Pending: nothing of the serving work; `all` with PyAV carried.
# Session 61 (H100 only) added and ran `c16tests`, `overhead`, `dpf` and `hostab`; pending: `oneloop` (written when the
# session's device time was spent) and the issue's table on an H200 (`table`; its B=16 error sums now fit an H100 too).
# Session 62 ran `c16roles` (an H200), `oneloop` and `s62` (H100s); pending: `s62b` (the CUDA tests and the flow's path
# at session 62's new defaults: no machine could be started for it), `s62c` (the direct attention's launch shape with
# pointer loads, and the replay profile), then `table`.
# Session 63 (no device lent) added `tail`: the staged direct solve reading each stream's last 100 old frames from its
# voice's prompt cache (WholeEulerSolver.share_tail, off until timed): its tests on the GPU, then the A/B at 4, 8, 16;
# and `s63`, which runs s62b's tests with the tail's in one pytest, the roles check and the tail A/B in one call (its
# share_tail=False rows are the flow's path at the new defaults, B=4-16). Pending, in this order: s63, table, s62c.
# Each step writes into its own folder, packed into $OUT/<step>.tar.gz (a device call brings back at most 8 files);
# log.txt has everything printed.
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh tests ab
# Steps (in the order given):
#   tests    CUDA tests of the carried HiFT decode, the conv views and the vocoder / HiFT-graph paths
#   carry    hift_carry_bench.py: steady decode rounds, bounded against carried, batches 1, 4, 16
#   prepare  precapture_probe.py: Code2Wav.prepare with the HiFT's conv views against F.conv1d
#   churn    stream_churn_bench.py --carry: 16-slot serving rounds, the default against hift_carry
#   starts   stream_churn_bench.py --starts: the default against cfm_join_starts (first and second chunks in the
#            steady solve), and that with hift_carry (rounds, CFM solves per round)
#   jtests   CUDA tests of rows of their own cache lengths (direct attention, block kernel, staged body)
#   all      the whole test suite on the GPU, without Triton's interpreter: every CUDA test at HEAD (the CPU tests
#            that need the interpreter skip there), on NPROC (4) pytest-xdist workers when the device has xdist
#   stage    hift_stage_probe.py: every stage call at every bucket (GROW_ROWS), after the conv views
#   ab       churn_ab.sh: the default's 16-slot serving rounds, the tree in _base/src (a baseline: `git archive
#            <commit> src | tar -x -C _base`) against this one, 3 alternating pairs (session 31: 6c7caf9, before
#            the final chunks' padded HiFT look-ahead calls and GROW_ROWS 8); CHURN_ARGS passes options on
#   ftests   CUDA tests of the final chunks' padded encoder calls (EncoderGraphs.ended, warm-up, serving)
#   ptests   CUDA tests of the slot pool in the pipeline (the wide final keys precaptured, finals joining)
#   pool     stream_churn_bench.py --breakdown --final-codes 1,25: the default against the slot pool (opt-in)
#   c16tests the CUDA tests of the fused body and slot pool (the cublas16 step without its probe)
#   overhead solve_overhead_probe.py at batches 1 and 16 (the flow's choices), then batch 1 on the direct path:
#            host steps and the GPU timeline of one solve as called (where "as called" exceeds the replay)
#   dpf      the block kernel's direct phase prefetching each row's old frames (kernels.dit_block.DIRECT_PREFETCH,
#            session 61): its CUDA tests, then off / on at batches 1-2 on the direct path, then batch 1 through the
#            arena (BLOCK_DIRECT_MIN_ROWS 200, the default) against the direct path (100), as called
#   hostab   solve_overhead_probe.py at batches 1 and 16, the tree in _base/src (`git archive <commit> src | tar -x -C
#            _base`) against this one, two alternating pairs (session 61: the solve's host steps before its replay)
#   oneloop  the block kernel's direct phase with one key loop over both sources (kernels.dit_block.DIRECT_ONE_LOOP, off
#            until timed) against two, batches 1-2 as called, then the arena path for reference (session 61: arena B=1
#            6.77-6.89 / B=2 8.92-8.97 ms replay, direct 7.55-7.67 / 10.60-10.78, direct without successor writes
#            7.39-7.55 / 10.33-10.46 on an H100); then B=2 as called, direct (its default since session 22) against
#            the arena (BLOCK_DIRECT_MIN_ROWS 300), whose replay was 1.7 ms shorter in session 61
#   c16roles the staged FP16 body's other GEMM roles on cuBLAS (fused_dit.CUBLAS16_ALL: the QKV with its head LNs
#            as a row stage, the convs as taps products, fc1 through cuBLASLt's GELU epilogue): their CUDA tests,
#            then cublas16_probe.py --roles against the default (out-proj + fc2), batches 16, 8, 4 as called
#   s62      session 62's follow-ups: the CUDA tests of the cuBLAS roles, the block kernel and the direct attention
#            (DIRECT_ONE_LOOP now on); the staged direct attention with one key loop (FusedDiT.direct_one_loop,
#            pointer loads) against two (TMA) at batches 16, 8, 4; cuBLAS role combinations with the convs; batch 1
#            through the arena (BLOCK_DIRECT_MIN_ROWS 200, the default) against the direct path with one loop
#   s62b     after session 62's new defaults (cuBLAS convs and fc1, one key loop in both direct attentions): the CUDA
#            tests of the fused body, slot pool, Whole-Euler graphs, batched pipeline and tiled attention;
#            cublas16_roles_check.py; the flow's path (FP16 and FP32 operands) at batches 1, 16, 4, 8
#   s62c     the staged attentions' pipeline depth (FusedDiT.attn_stages 3, the default, against 4), the direct
#            attention's key tile (FusedDiT.direct_block_n 64 against 32, 128) and its warps (4 against 8), now that it
#            loads through pointers; then the replay profile at the new defaults (batches 1, 8, 16)
#   s63      one call for what sessions 62-63 left: the CUDA tests of s62b and the tail's in one pytest,
#            cublas16_roles_check.py, then shared_tail_probe.py (B=4, 8, 16; its share_tail=False rows are the flow's
#            path at session 62's defaults, replay and as called)
#   tail     the shared prompt tails (WholeEulerSolver.share_tail, FlowCache.prompt_att): their tests on the GPU (the
#            kernel reading the tail from the shared copy, the solver's, the flow's chunks), then shared_tail_probe.py:
#            own frames / shared tail / shared tail + reused successors, alternating at batches 4, 8, 16 as the flow
#            calls the solve (bit-identical outputs)
#   profile  code2wav_replay_profile.py: GPU time by kernel class of the flow's trimmed solve (the direct path from
#            batch 4) and the untrimmed arena solve, batches 1, 8, 16
#   dtests   CUDA tests of the Talker (turn engine, duplex TalkerTurns: fused against torch, graphs), the duplex
#            conversations and the turn pipeline
#   duplex   duplex_batch_bench.py: one second of 8 and 16 concurrent conversations (batch-rows, greedy), the Talker's
#            draws on the fused kernels (compare duplex_batch_bench_session42b_h200.md, its bucketed torch step)
#   admit    talker_first_run_probe.py --profile-admit: 16-request turns of a new length each run, each admission
#            under cProfile, the requests' hidden rows on the host (the contract), pinned, then on the device
#   admitab  admit_stall_probe.py (the host join of the hidden rows under the cgroup's CPU quota; the projector's
#            first call at a new row count), then talker_first_run_probe.py at 1 and 16 requests, answers of a new
#            length each run: this tree (rows on the Thinker's device, padded projector, one state write per
#            admission) against _base/src (`git archive abad46e src | tar -x -C _base`), two alternating pairs
#   duplexab duplex_batch_bench.py at 16 conversations: this tree against _base/src, two alternating pairs (session 50
#            measured the duplex Talker's hidden rows kept on the device, instead of one host copy per decode step)
#   mtests   CUDA tests of the batched mel (process_many), the session's and the duplex batch's
#   melab    duplex_batch_bench.py at 16 conversations, this tree against _base/src (session 50: 56ad7be), two
#            alternating pairs, the first with the Thinker split by part (--parts 16)
#   melab1   duplex_batch_bench.py at 16 conversations in one process: batch-rows against batch-rows-mel (the opt-in
#            batched mel), alternating twice
#   melnf    melab1 with audio-only units (--no-frame): no vision encoder's GPU work ahead of the commits for the
#            mel's host time to hide under (session 51's explanation of melab1); 14 seconds per run (UNITS), 4 warm
#   melf     the same with the frame, as melab1 but 14 seconds per run; both record each second's allocator calls,
#            collections and SM clock (--diag); ORDER=kind,kind,... overrides the runs' order
#   qwait    the CUDA tests of the uploads that must not wait (mel batch, audio steps and forks, staging, the Talker's
#            admission) and of the paths whose uploads session 51 staged (static rows, Talker engine and turns), then
#            queued_wait_probe.py at 16 conversations, each mel form: which stages of a duplex second wait for
#            ~1 s of device work queued before them (session 51 staged the audio steps' and prefill's positions)
#   wtests   CUDA tests of the duplex warm-up (every seat fresh after it, the Talker's prefill graphs precaptured)
#   warm20   duplex_batch_bench.py at 16 conversations, 20 seconds after DuplexBatch.warm_up(2) (--diag): seconds 8
#            and 16 (the Talker's 512 and 1024 attention buckets) should now run as fast as their neighbours
#   holdab   duplex_batch_bench.py at 16 conversations after a 2-s warm-up (--diag), UNITS (12) seconds: this tree
#            against _base/src (session 53: 8ea4de6, before HostStaging.hold), two alternating pairs
#   parts7   duplex_batch_bench.py --parts 16 alone, UNITS (7) seconds after a 2-s warm-up, --diag: each second's
#            Thinker split by part (session 53: seconds 1 and 4 after a warm-up take ~20 ms more in the Thinker)
#   htests   CUDA tests of HostStaging.hold (session 53: a session holds its mel's largest upload when it opens),
#            the mel's and the session's
#   serve    tests/serving (the HTTP server: turn and duplex modes, the CLI) with CUDA present, then serve_bench.py:
#            N concurrent streamed turns through the server against the pipeline called directly (session 55), then
#            the same with arrivals 250 ms apart: mid-batch joining against batches (session 56); `sbench` and
#            `stagger` are its two benchmark steps alone
#   lead     serve_bench.py with 15-s answers (48 tokens, 375 codes), N = 8, 16 arriving 250 ms apart: batches against
#            joining, with and without the Talker's lead (TurnPipeline.talker_lead_s, session 57), with each client's
#            real-time playback stalls; `lead50`: the same at 50 ms apart with session 56's 4-s answers. PATHS picks
#            serve_bench's --paths (e.g. http-batched,http,http-side,http-lead-side: the Talker on its own stream);
#            REQUESTS its N (default 8,16: on an H100 three paths fit the step's 540 s, four did not reach N=16)
#   sidetest the turn pipeline's CUDA tests (the Talker on its own stream among them, session 57)
#   alloc    duplex_batch_bench.py --alloc-sites: which code made each second's new allocator segments (session 54:
#            16 x 500 MiB at second 2 after a 2-s warm-up)
#   stests   CUDA tests of the mel's plans and the staging ring's slot choice (session 52), then mel_wait_probe.py
#   commits  duplex_batch_bench.py: the seconds' commits prefilled together (batch-rows, commit_many) against each
#            alone (batch-rows-each), and together again after it (the order's effect), 8 and 16 conversations, greedy
#            and sampling: session 46 measured the Thinker 222 -> 179 ms at 16 (greedy) in one run, whose Talker
#            column moved by +41 ms with no Talker change (duplex_batch_bench_session46d_commit_many_h200.md)
#   fp16     session 59: the CUDA tests of the FP16 range certificate and of the solver / pipelines whose default it
#            changes, then the flow's direct rows with FP32 and with FP16 operands at B=1,4,8,16 (one run)
#   cublas16 session 60: the CUDA tests of the fused body and slot pool (the staged FP16 body's out-proj and fc2 as
#            cuBLAS FP16 GEMMs), then cublas16_probe.py: tile GEMMs against cuBLAS ones at B=16,8,4 (one run)
#   table    code2wav_bench.py: the issue's table (session 22's rows, slot pool, row merging, whole flow chunk,
#            HiFT, upstream minicpmo-utils 1.0.7 inference_chunk from .upstream_ref, which git ignores: unpack
#            `pip download --no-deps minicpmo-utils==1.0.7`, copy its src/ to .upstream_ref and carry it), one call
# Before the call, here: copy ../shared/minicpmo45 into _shared/ and download soundfile's wheels into _wheels/
# (see benchmarks/results/code2wav_session29_h200.md), and carry both. SMOKE=1 runs the benchmark steps on the
# CPU at tiny sizes (a check of this script, not a measurement).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc}
OUT=${OUT:?set OUT to the folder that comes back}
W=${W:-/tmp/gpu_pending}
mkdir -p "$OUT" "$W"
# carried wheels fill in what the device image lacks; a package the image already has is left as it is
if [ -d _wheels ]; then
  python -m pip install -q --no-deps --no-index --find-links _wheels $(ls _wheels | sed 's/-.*//') || exit 1
fi
python -m pip list 2>/dev/null > "$OUT/pip_list.txt"
if [ -d _shared/minicpmo45 ] && [ ! -d ../shared/minicpmo45 ]; then mkdir -p ../shared && cp -r _shared/minicpmo45 ../shared/; fi
tiny=(); if [ -n "${SMOKE:-}" ]; then tiny=(--tiny --device cpu); fi
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/benchmarks
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"; } \
  | tee -a "$OUT/log.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log.txt"

step() {   # step NAME TIMEOUT_S COMMAND...: run, log, pack its folder
  local name=$1 limit=$2; shift 2
  mkdir -p "$W/$name"
  echo "== $name ($(date -u +%T)): $*" | tee -a "$OUT/log.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$W/$name/output.txt" | tee -a "$OUT/log.txt" | grep -E "passed|failed|Error|^\| " | tail -40
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
  tar -czf "$OUT/$name.tar.gz" -C "$W" "$name"
}

for s in "$@"; do
  case $s in
    tests) step tests 240 python -m pytest -q -p no:cacheprovider -k cuda tests/code2wav/test_hift_carry.py \
             tests/code2wav/test_hift_graph.py tests/code2wav/test_vocoder_batched.py tests/code2wav/test_hift_fast.py ;;
    carry) step carry 180 python benchmarks/hift_carry_bench.py --out "$W/carry" --batches 1,4,16 "${tiny[@]}" ;;
    prepare) step prepare 150 python benchmarks/precapture_probe.py --out "$W/prepare" --warmups 1 \
               --conv-views default,off --runs 2 "${tiny[@]}" ;;
    churn) step churn 300 python benchmarks/stream_churn_bench.py --carry --no-slot-pool --out "$W/churn" "${tiny[@]}" ;;
    starts) step starts 380 python benchmarks/stream_churn_bench.py --starts --out "$W/starts" "${tiny[@]}" ;;
    jtests) step jtests 300 python -m pytest -q -p no:cacheprovider tests/code2wav/test_tiled_attention.py \
              tests/code2wav/test_euler_graph.py tests/code2wav/test_pipeline_batched.py tests/code2wav/test_pipeline.py \
              tests/code2wav/test_encoder_graph.py -k "own_cache_lengths or join_the_steady or join_starts or joined or direct or padded" ;;
    ftests) step ftests 300 python -m pytest -q -p no:cacheprovider tests/code2wav/test_encoder_graph.py \
              tests/code2wav/test_pipeline.py -k cuda ;;
    ptests) step ptests 240 python -m pytest -q -p no:cacheprovider tests/code2wav/test_pipeline_slot_pool.py \
              tests/code2wav/test_slot_pool.py -k cuda ;;
    pool) step pool 330 python benchmarks/stream_churn_bench.py --breakdown --final-codes 1,25 --only default \
            --runs 2 --out "$W/pool" "${tiny[@]}" ;;
    table) [ -d .upstream_ref/stepaudio2 ] || { echo "gpu_pending.sh table: no .upstream_ref/stepaudio2" \
             "(copy the src/ folder of pip download --no-deps minicpmo-utils==1.0.7 there and carry it)" >&2; exit 2; }
           step table 555 python benchmarks/code2wav_bench.py --out "$W/table" --batches 1,16,4,8 --budget 0.3 \
             --upstream .upstream_ref --rows "=original + graph|=fused + graph TF32 on|=fused + graph TF32 off|=fused + graph IEEE|=fused + graph TF32 on, trimmed, arena|=fused + graph TF32 on, trimmed, direct|=fused + graph TF32 on, FP16 operands, trimmed, direct" ;;
    fp16) n=1; python -c "import xdist" 2>/dev/null && n=${NPROC:-4}
          step fp16tests 300 python -m pytest -q -p no:cacheprovider -n "$n" -rsf tests/code2wav/test_operand_range.py \
            tests/code2wav/test_knobs.py tests/code2wav/test_euler_graph.py tests/code2wav/test_slot_pool.py \
            tests/code2wav/test_pipeline.py tests/code2wav/test_pipeline_batched.py tests/code2wav/test_pipeline_slot_pool.py
          step fp16rows 280 python benchmarks/code2wav_bench.py --out "$W/fp16rows" --batches 1,16,4,8 --budget 0.3 \
            --only graphs --rows "=fused + graph TF32 on, trimmed, direct|=fused + graph TF32 on, FP16 operands, trimmed, direct" ;;
    cublas16|c16tests) n=1; python -c "import xdist" 2>/dev/null && n=${NPROC:-4}
              step c16tests 240 python -m pytest -q -p no:cacheprovider -n "$n" -rsf tests/code2wav/test_fused_dit.py \
                tests/code2wav/test_slot_pool.py tests/code2wav/test_pipeline_slot_pool.py -k cuda
              if [ "$s" = cublas16 ]; then
                step c16probe 240 python benchmarks/cublas16_probe.py --out "$W/c16probe" --batches 16,8,4
              fi ;;
    overhead) step overhead 240 python benchmarks/solve_overhead_probe.py --out "$W/overhead" --batches 1,16
              step overhead_direct1 150 python benchmarks/solve_overhead_probe.py --out "$W/overhead_direct1" \
                --batches 1 --direct on ;;
    dpf) step dpftests 200 python -m pytest -q -p no:cacheprovider -rsf tests/code2wav/test_euler_graph.py \
           -k "block_kernel or direct"
         step dpf 240 python benchmarks/solve_switch_probe.py --out "$W/dpf" --attr kernels.dit_block.DIRECT_PREFETCH \
           --values 0,1 --batches 1,2 --trim --called --direct on --gemm-operands fp16
         step dpf1 200 python benchmarks/solve_switch_probe.py --out "$W/dpf1" \
           --attr euler_graph.BLOCK_DIRECT_MIN_ROWS --values 200,100 --batches 1 --trim --called --gemm-operands fp16 ;;
    hostab) for i in 1 2; do    # PYTHONPATH as this script's, with the baseline's src first
              step "hostab_base$i" 150 env PYTHONPATH="$PWD/_base/src:$PWD/tests:$PWD/benchmarks" \
                python benchmarks/solve_overhead_probe.py --out "$W/hostab_base$i" --batches 1,16
              step "hostab_new$i" 150 python benchmarks/solve_overhead_probe.py --out "$W/hostab_new$i" --batches 1,16
            done ;;
    oneloop) step oneloop 200 python benchmarks/solve_switch_probe.py --out "$W/oneloop" \
               --attr kernels.dit_block.DIRECT_ONE_LOOP --values 0,1 --batches 1,2 --trim --called --direct on \
               --gemm-operands fp16
             step oneloop_arena 100 python benchmarks/solve_switch_probe.py --out "$W/oneloop_arena" \
               --attr kernels.dit_block.DIRECT_ONE_LOOP --values 0 --batches 1,2 --trim --called --direct off \
               --gemm-operands fp16
             step oneloop_b2 120 python benchmarks/solve_switch_probe.py --out "$W/oneloop_b2" \
               --attr euler_graph.BLOCK_DIRECT_MIN_ROWS --values 200,300 --batches 2 --trim --called --gemm-operands fp16 ;;
    c16roles) n=1; python -c "import xdist" 2>/dev/null && n=${NPROC:-4}
              step c16rtests 200 python -m pytest -q -p no:cacheprovider -n "$n" -rsf --durations=10 \
                tests/code2wav/test_fused_dit.py -k "cublas16 or wide16"
              step c16roles 330 python benchmarks/cublas16_probe.py --out "$W/c16roles" --batches 16,8,4 \
                --roles "proj+fc2,qkv+proj+fc2,proj+conv+fc2,proj+fc1+fc2,all" ;;
    s62) n=1; python -c "import xdist" 2>/dev/null && n=${NPROC:-4}
         step s62tests 280 python -m pytest -q -p no:cacheprovider -n "$n" -rsf --durations=10 \
           tests/code2wav/test_fused_dit.py tests/code2wav/test_euler_graph.py tests/code2wav/test_tiled_attention.py \
           -k "cublas16 or wide16 or block_kernel or direct"
         step olstaged 150 python benchmarks/solve_switch_probe.py --out "$W/olstaged" --attr FusedDiT.direct_one_loop \
           --values 0,1 --batches 16,8,4 --trim --called --direct on --gemm-operands fp16
         step c16combo 200 python benchmarks/cublas16_probe.py --out "$W/c16combo" --batches 16,8,4 \
           --roles "proj+fc2,proj+conv+fc2,proj+conv+fc1+fc2,all"
         step b1path 100 python benchmarks/solve_switch_probe.py --out "$W/b1path" \
           --attr euler_graph.BLOCK_DIRECT_MIN_ROWS --values 200,100 --batches 1 --trim --called --gemm-operands fp16 ;;
    s62b) n=1; python -c "import xdist" 2>/dev/null && n=${NPROC:-4}
          step s62btests 300 python -m pytest -q -p no:cacheprovider -n "$n" -rsf --durations=10 -k cuda \
            tests/code2wav/test_fused_dit.py tests/code2wav/test_slot_pool.py tests/code2wav/test_pipeline_slot_pool.py \
            tests/code2wav/test_euler_graph.py tests/code2wav/test_pipeline_batched.py tests/code2wav/test_tiled_attention.py
          step rolescheck 90 python benchmarks/cublas16_roles_check.py
          step flowrows 200 python benchmarks/code2wav_bench.py --out "$W/flowrows" --batches 1,16,4,8 --budget 0.3 \
            --only graphs --rows "=fused + graph TF32 on, trimmed, direct|=fused + graph TF32 on, FP16 operands, trimmed, direct" ;;
    s62c) step olstages 100 python benchmarks/solve_switch_probe.py --out "$W/olstages" --attr FusedDiT.attn_stages \
            --values 3,4 --batches 16,8 --trim --called --direct on --gemm-operands fp16
          step olbn 100 python benchmarks/solve_switch_probe.py --out "$W/olbn" --attr FusedDiT.direct_block_n \
            --values 64,32,128 --batches 16,8 --trim --called --direct on --gemm-operands fp16
          step olwarps 100 python benchmarks/solve_switch_probe.py --out "$W/olwarps" --attr FusedDiT.attn_warps \
            --values 4,8 --batches 16,8 --trim --called --direct on --gemm-operands fp16
          step profile62 240 python benchmarks/code2wav_replay_profile.py --out "$W/profile62" --batches 1,8,16 \
            --variants "FP16 operands" ;;
    s63) n=1; python -c "import xdist" 2>/dev/null && n=${NPROC:-4}
         step s63tests 300 python -m pytest -q -p no:cacheprovider -n "$n" -rsf --durations=10 \
           -k "cuda or shared_tail or shared_prompt_tails or direct_solves_match" \
           tests/code2wav/test_fused_dit.py tests/code2wav/test_slot_pool.py tests/code2wav/test_pipeline_slot_pool.py \
           tests/code2wav/test_euler_graph.py tests/code2wav/test_pipeline_batched.py tests/code2wav/test_tiled_attention.py
         step rolescheck 60 python benchmarks/cublas16_roles_check.py
         step tail 200 python benchmarks/shared_tail_probe.py --out "$W/tail" --batches 4,8,16 ;;
    tail) step tailtests 300 python -m pytest -q -p no:cacheprovider -rsf --durations=10 \
            tests/code2wav/test_tiled_attention.py tests/code2wav/test_euler_graph.py \
            tests/code2wav/test_pipeline_batched.py -k "shared_tail or shared_prompt_tails or direct_solves_match"
          step tail 240 python benchmarks/shared_tail_probe.py --out "$W/tail" --batches 4,8,16 ;;
    profile) step profile 300 python benchmarks/code2wav_replay_profile.py --out "$W/profile" --batches 1,8,16 \
               --variants "flow's path|default (arena)" ;;
    all) n=1; python -c "import xdist" 2>/dev/null && n=${NPROC:-4}
         step all 570 python -m pytest -q -p no:cacheprovider -n "$n" -rsf --durations=40 tests/ ;;
    admit) hs="host pinned device"; [ -n "${SMOKE:-}" ] && hs="host device"    # pinned memory needs CUDA
           for h in $hs; do
             step "admit_$h" 150 python benchmarks/talker_first_run_probe.py "$W/admit_$h" --runs 6 --requests 16 \
               --vary-tokens --profile-admit --profile-admit-dir "$W/admit_$h/prof" --hidden-rows "$h" \
               ${SMOKE:+--tiny --runs 1 --requests 2}
           done ;;
    admitab) step stall 120 python benchmarks/admit_stall_probe.py "$W/stall" ${SMOKE:+--device cpu --reps 5}
             for k in 1 2; do
               for form in after before; do    # before: the tree in _base/src (session 50: abad46e)
                 src=$PWD/src; [ "$form" = before ] && src=$PWD/_base/src
                 step "admit_${form}_$k" 240 env PYTHONPATH="$src:$PWD/tests:$PWD/benchmarks" \
                   python benchmarks/talker_first_run_probe.py "$W/admit_${form}_$k" --runs 6 --requests 1,16 \
                   --vary-tokens ${SMOKE:+--tiny --runs 1 --requests 2}
               done
             done ;;
    duplexab) for k in 1 2; do
                for form in after before; do
                  src=$PWD/src; [ "$form" = before ] && src=$PWD/_base/src
                  step "duplex_${form}_$k" 200 env PYTHONPATH="$src:$PWD/tests:$PWD/benchmarks" \
                    python benchmarks/duplex_batch_bench.py "$W/duplex_${form}_$k" --conversations 16 \
                    --batch-kinds batch-rows --sequential "" --decode greedy --units 6 --warm 2 \
                    ${SMOKE:+--tiny --conversations 2 --units 2 --warm 1}
                done
              done ;;
    holdab) for k in 1 2; do    # session 53: HostStaging.hold against _base/src (8ea4de6), after a warm-up
              for form in after before; do
                src=$PWD/src; [ "$form" = before ] && src=$PWD/_base/src
                step "hold_${form}_$k" 150 env PYTHONPATH="$src:$PWD/tests:$PWD/benchmarks" \
                  python benchmarks/duplex_batch_bench.py "$W/hold_${form}_$k" --conversations 16 \
                  --batch-kinds batch-rows --sequential "" --decode greedy --units "${UNITS:-12}" --warm 2 --warm-up 2 \
                  --diag ${SMOKE:+--tiny --conversations 2 --units 2 --warm 1 --warm-up 1}
              done
            done ;;
    mtests) step mtests 300 python -m pytest -q -p no:cacheprovider -rsf tests/thinker/test_mel.py \
              tests/thinker/test_session.py tests/thinker/test_audio_chunks.py tests/runtime/test_duplex.py -k "cuda" ;;
    melab) for k in 1 2; do        # session 50: the commits' mels in one batch (mel.process_many) against _base/src
             for form in after before; do
               src=$PWD/src; [ "$form" = before ] && src=$PWD/_base/src
               parts=(); [ "$k" = 1 ] && parts=(--parts 16)
               step "mel_${form}_$k" 200 env PYTHONPATH="$src:$PWD/tests:$PWD/benchmarks" \
                 python benchmarks/duplex_batch_bench.py "$W/mel_${form}_$k" --conversations 16 \
                 --batch-kinds batch-rows --sequential "" --decode greedy --units 6 --warm 2 "${parts[@]}" \
                 ${SMOKE:+--tiny --conversations 2 --units 2 --warm 1}
             done
           done ;;
    melab1) step melab1 420 python benchmarks/duplex_batch_bench.py "$W/melab1" --conversations 16 \
              --batch-kinds batch-rows,batch-rows-mel,batch-rows,batch-rows-mel --sequential "" --decode greedy \
              --units 6 --warm 2 ${SMOKE:+--tiny --conversations 2 --units 2 --warm 1} ;;
    melnf|melf) nf=(); [ "$s" = melnf ] && nf=(--no-frame)
             step "$s" 540 python benchmarks/duplex_batch_bench.py "$W/$s" --conversations 16 "${nf[@]}" \
             --batch-kinds batch-rows,batch-rows-mel,batch-rows,batch-rows-mel --sequential "" --decode greedy \
             --units "${UNITS:-14}" --warm 4 --diag ${ORDER:+--batch-kinds "$ORDER"} ${SMOKE:+--tiny --conversations 2 --units 2 --warm 1} ;;
    qwait) step qtests 400 python -m pytest -q -p no:cacheprovider -rsf -k "never_wait or cuda or graph" \
             tests/thinker/test_mel.py tests/thinker/test_audio_chunks.py tests/thinker/test_audio_forks.py \
             tests/thinker/test_staging.py tests/thinker/test_llm_cache.py tests/talker/test_model_engine.py \
             tests/talker/test_chunked.py
           for m in "" --batched-mel; do
             step "qwait${m:+_mel}" 240 python benchmarks/queued_wait_probe.py "$W/qwait${m:+_mel}" --conversations 16 $m \
               ${SMOKE:+--tiny --conversations 2 --warm 1}
           done ;;
    wtests) step wtests 300 python -m pytest -q -p no:cacheprovider -rsf tests/runtime/test_duplex.py -k "warm_up and cuda" ;;
    warm20) step warm20 300 python benchmarks/duplex_batch_bench.py "$W/warm20" --conversations 16 --batch-kinds batch-rows \
              --sequential "" --decode greedy --units "${UNITS:-20}" --warm 2 --warm-up 2 --diag \
              ${SMOKE:+--tiny --conversations 2 --units 3 --warm 1 --warm-up 1} ;;
    htests) step htests 240 python -m pytest -q -p no:cacheprovider -rsf tests/thinker/test_staging.py \
              tests/thinker/test_mel.py tests/thinker/test_session.py -k cuda ;;
    serve) step servetests 300 python -m pytest -q -p no:cacheprovider -rsf tests/serving
           step serve 420 python benchmarks/serve_bench.py "$W/serve" \
             ${SMOKE:+--tiny --requests 1,2 --tokens 4 --codes 30 --repeat 1}
           step stagger 420 python benchmarks/serve_bench.py "$W/stagger" --requests 8,16 --stagger-ms 250 \
             ${SMOKE:+--tiny --requests 2 --tokens 4 --codes 30 --repeat 1} ;;
    sbench) step serve 420 python benchmarks/serve_bench.py "$W/serve" \
              ${SMOKE:+--tiny --requests 1,2 --tokens 4 --codes 30 --repeat 1} ;;
    stagger) step stagger 420 python benchmarks/serve_bench.py "$W/stagger" --requests 8,16 --stagger-ms 250 \
               ${SMOKE:+--tiny --requests 2 --tokens 4 --codes 30 --repeat 1} ;;
    stagger50) step stagger50 300 python benchmarks/serve_bench.py "$W/stagger50" --requests 16 --stagger-ms 50 \
                 ${SMOKE:+--tiny --requests 2 --tokens 4 --codes 30 --repeat 1} ;;
    lead) step lead 540 python benchmarks/serve_bench.py "$W/lead" --requests "${REQUESTS:-8,16}" --stagger-ms 250 \
            --tokens 48 --codes 375 --paths "${PATHS:-http-batched,http,http-lead}" \
            ${SMOKE:+--tiny --requests 2 --tokens 4 --codes 30 --repeat 1} ;;
    lead50) step lead50 300 python benchmarks/serve_bench.py "$W/lead50" --requests 16 --stagger-ms 50 \
              --paths "${PATHS:-http-batched,http,http-lead}" ${SMOKE:+--tiny --requests 2 --tokens 4 --codes 30 --repeat 1} ;;
    sidetest) step sidetest 240 python -m pytest -q -p no:cacheprovider -rsf tests/runtime/test_turn.py \
                -k "cuda" ;;
    alloc) step alloc 300 python benchmarks/duplex_batch_bench.py "$W/alloc" --conversations 16 --batch-kinds batch-rows \
             --sequential "" --decode greedy --units "${UNITS:-7}" --warm 2 --warm-up 2 --alloc-sites \
             ${SMOKE:+--tiny --conversations 2 --units 3 --warm 1 --warm-up 1} ;;
    parts7) step parts7 300 python benchmarks/duplex_batch_bench.py "$W/parts7" --batch-kinds "" --sequential "" \
              --decode greedy --units "${UNITS:-7}" --warm 2 --warm-up 2 --diag --parts 16 \
              ${SMOKE:+--tiny --parts 2 --units 3 --warm 1 --warm-up 1} ;;
    stests) step stests 200 python -m pytest -q -p no:cacheprovider -rsf tests/thinker/test_mel.py \
              tests/thinker/test_staging.py -k cuda
            [ -z "${SMOKE:-}" ] && step melwait 120 python benchmarks/mel_wait_probe.py "$W/melwait/mel_wait.txt" \
              --streams 16 --frames 16 --steps 6 ;;
    dtests) n=1; python -c "import xdist" 2>/dev/null && n=${NPROC:-6}
            step dtests 540 python -m pytest -q -p no:cacheprovider -n "$n" -rsf --durations=15 tests/talker \
              tests/runtime/test_duplex.py tests/runtime/test_turn.py ;;
    duplex) step duplex 420 python benchmarks/duplex_batch_bench.py "$W/duplex" --conversations 8,16 \
              --batch-kinds batch-rows --sequential "" ${SMOKE:+--tiny} ;;
    commits) step commits 500 python benchmarks/duplex_batch_bench.py "$W/commits" --conversations 8,16 \
               --batch-kinds batch-rows,batch-rows-each,batch-rows --sequential "" --decode greedy,sampling \
               ${SMOKE:+--tiny --units 2 --warm 1} ;;
    stage) step stage 120 python benchmarks/hift_stage_probe.py --out "$W/stage" "${tiny[@]}" ;;
    ab) [ -d _base/src ] || { echo "gpu_pending.sh ab: no _base/src (git archive <commit> src | tar -x -C _base)" >&2
          exit 2; }
        step ab 560 env OUT="$W/ab" bash benchmarks/churn_ab.sh _base/src
        python benchmarks/churn_ab_table.py "$W/ab" --out "$W/ab/churn_ab" 2>&1 | tail -8 | tee -a "$OUT/log.txt"
        tar -czf "$OUT/ab.tar.gz" -C "$W" ab ;;
    *) echo "gpu_pending.sh: unknown step '$s' (all, tests, carry, prepare, churn, starts, jtests, stage, ab, ftests, ptests, pool, table, profile, dtests, duplex, commits)" >&2
       exit 2 ;;
  esac
done
