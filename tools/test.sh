#!/usr/bin/env bash
# The test command (README.md, .ci/run): set up if needed, then run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# Two workers (TEST_WORKERS), a test file each at a time, longest first (tests/conftest.py), so that module fixtures
# are built once: most tests wait on one process's imports with a core idle, and the layout tests' launches keep
# both cores busy while the other worker runs the rest. The slowest tests are printed at the end (CI's time limit).
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
