#!/usr/bin/env bash
# The test command (README.md, .ci/run): set up if needed, then run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# Two workers (TEST_WORKERS), a test file each at a time, longest first (tests/conftest.py), so that module fixtures
# are built once: most tests wait on one process's imports with a core idle, and the layout tests' launches keep
# both cores busy while the other worker runs the rest. The slowest tests are printed at the end (CI's time limit).
# Inductor compiles in the test's own process: its default pool of compile workers (one a core) costs each compiling
# process their start-up, on cores the suite's other worker is using (test_mechanisms' compiled cases: 5-10 % less).
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}"
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
