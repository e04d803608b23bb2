#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Exit status is pytest's, except that
# "no tests collected" (pytest's 5) is a failure, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
. .venv/bin/activate
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
# conftest runs every test on one torch thread (tiny models are launch-bound), so a single pytest
# process would leave the CI box's second core idle: pytest-xdist runs one worker per core, at most 4
# (on 2 cores about half the one-process time; once 5 minutes against 9). PYTEST_WORKERS=0 runs the tests in this process (pdb, -x). pyproject.toml
# asks pytest for the 12 slowest tests, so a CI log shows what eats the 15-minute budget.
cores=$(nproc 2>/dev/null || echo 1)
workers=${PYTEST_WORKERS:-$(( cores < 2 ? 0 : (cores > 4 ? 4 : cores) ))}
python -m pytest -q -n "$workers" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
