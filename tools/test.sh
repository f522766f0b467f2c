#!/usr/bin/env bash
# The test command (README.md, .ci/run): set up if needed, then run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/python -m pytest -q "$@"
