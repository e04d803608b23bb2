#!/usr/bin/env bash
# Set up (if needed), write the built-in tiny checkpoint and run the main jobs on it:
#   1. spoken reply: Thinker -> Talker -> Code2Wav (turn mode), whole and streamed Code2Wav;
#      a duplex conversation over a recorded user side (one unit per second: listen or speak);
#      a turn whose question is that recording (the Thinker hears it);
#   2. research chain: synthetic EasyCom sessions -> causal features (both modes, audited)
#      -> turn-taking labels -> turn head (k-fold by session).
# The tiny checkpoint has RANDOM weights: its audio is noise, its text gibberish and the
# turn head's scores say nothing about MiniCPM-o. It proves the plumbing, not quality.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${MINICPMO_RT_SKIP_SETUP:-0}" != 1 ]; then  # 1: use the active environment as it is
  bash scripts/setup.sh
  . .venv/bin/activate
fi
# The tiny model's matmuls are too small to gain from intra-op threads; they only contend.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${DEMO_OUT:-demo_out}
mkdir -p "$OUT"
echo "== tiny checkpoint (random weights) =="
minicpmo-rt make-tiny "$OUT/tiny" --seed 0 --force
minicpmo-rt inspect --model "$OUT/tiny"
VOICE="$OUT/tiny/assets/HT_ref_audio.wav"

echo "== spoken reply: Thinker -> Talker -> Code2Wav (random weights: the audio is noise) =="
minicpmo-rt speak --model "$OUT/tiny" --text "Hello! What should we cook tonight?" --voice "$VOICE" \
  --output "$OUT/reply.wav" --codes-out "$OUT/reply_codes.json" --max-new-tokens 16 --max-codes 75 --min-codes 25
minicpmo-rt code2wav --model "$OUT/tiny" --codes "$OUT/reply_codes.json" --voice "$VOICE" \
  --output "$OUT/reply_streamed.wav" --stream

echo "== duplex: the reply above as the user's side, one unit per second (random weights) =="
minicpmo-rt duplex --model "$OUT/tiny" --input "$OUT/reply.wav" --voice "$VOICE" \
  --output "$OUT/duplex_reply.wav" --transcript "$OUT/duplex_units.json" --force-listen-units 1

echo "== a spoken question: the reply above as the user's recording, answered in turn mode (random weights) =="
minicpmo-rt speak --model "$OUT/tiny" --audio "$OUT/reply.wav" --text "What did I just say?" --voice "$VOICE" \
  --output "$OUT/spoken_reply.wav" --max-new-tokens 8 --max-codes 50 --min-codes 25

echo "== research chain: synthetic EasyCom -> causal features -> labels -> turn head =="
rm -rf "$OUT/easycom" "$OUT/features" "$OUT/targets" "$OUT/turn_head"
mkdir -p "$OUT/targets" "$OUT/features/native_1hz_hold" "$OUT/features/cached_partial_5hz"
for S in 1 2 3; do
  minicpmo-rt make-session "$OUT/easycom" --session "$S" --seconds 10 --width 64 --height 48 --seed "$S"
  minicpmo-rt make-targets --easycom-root "$OUT/easycom" --session "$S" --output "$OUT/targets/Session_$S.npy"
  python streaming_minicpmo_features_directly.py --model-id "$OUT/tiny" \
    --easycom-session-dir "$OUT/easycom/Video_Compressed/Session_$S" --end 9 --mode native-1hz-hold \
    --decoder pyav --device cpu --dtype float32 --output "$OUT/features/native_1hz_hold/Session_$S.pt"
done
python streaming_minicpmo_features_directly.py --model-id "$OUT/tiny" \
  --easycom-session-dir "$OUT/easycom/Video_Compressed/Session_1" --end 3 --mode cached-partial-5hz \
  --decoder pyav --device cpu --dtype float32 --output "$OUT/features/cached_partial_5hz/Session_1.pt"
python train_turn_head.py --feature-root "$OUT/features/native_1hz_hold" --targets-root "$OUT/targets" \
  --split kfold:3 --model tcn --epochs 5 --out "$OUT/turn_head" --force
echo "demo outputs are in $OUT/ (tiny checkpoint: random weights, so audio is noise and scores are chance)"
