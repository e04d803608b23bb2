#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Exit status is pytest's, except that
# "no tests collected" (pytest's 5) is a failure, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
. .venv/bin/activate
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
