#!/usr/bin/env bash
# The TPU path's real test, on the CPU PJRT device: its own venv (.venv-xla, tools/setup_xla.sh), then tests/xla (one
# device, and 2-device SPMD: data parallel and FSDP), each XLA run in its own process.
#   bash tools/test_xla.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh  # the main environment: the tests export and load the Hugging Face folder there
bash tools/setup_xla.sh
exec env PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -q -p no:cacheprovider tests/xla "$@"
