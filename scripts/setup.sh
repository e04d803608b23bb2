#!/usr/bin/env bash
# Create .venv and install minicpmo-rt with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
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
