#!/usr/bin/env bash
# Create .venv and install minicpmo-rt with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  # A fresh .venv takes about 3 GB (triton 1.0, torch 0.75); pip stopping half-way with ENOSPC leaves a
  # broken environment and an unhelpful message, so say what is missing before starting.
  need_mb=${MINICPMO_SETUP_NEED_MB:-3500}
  free_mb=$(df -Pm . 2>/dev/null | awk 'NR==2 {print $4}')
  if [ -n "$free_mb" ] && [ "$free_mb" -lt "$need_mb" ]; then
    echo "scripts/setup.sh: $(pwd) has ${free_mb} MB free; the test environment (.venv) needs about" \
         "${need_mb} MB. Free disk space (old clones, /tmp) and run it again." >&2
    exit 1
  fi
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check --upgrade pip
# The CPU wheel of torch lies on disk here; asking for a bare 'torch' would pull a CUDA build.
python -m pip install -q --disable-pip-version-check "torch==2.13.0"
python -m pip install -q --disable-pip-version-check -e ".[test]"
# Upstream token2wav classes, the independent reference of the Code2Wav parity tests.
# --no-deps: its pins (torchaudio, old transformers, pillow) would replace our torch stack.
python -m pip install -q --disable-pip-version-check --no-deps "minicpmo-utils==1.0.7"
