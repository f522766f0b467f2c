#!/usr/bin/env bash
# The TPU path's real test, on the CPU PJRT device: its own venv (.venv-xla) with torch 2.9.0 and torch-xla 2.9.0
# (torch-xla 2.9.0 requires exactly torch 2.9.0; PyPI's is the CUDA build, ~4 GB of wheels, which runs on CPU),
# then tests/xla (one device, and 2-device SPMD: data parallel and FSDP), each XLA run in its own process.
#   bash tools/test_xla.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh  # the main environment: the tests export and load the Hugging Face folder there
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv-xla/bin/python ]; then
  "$PYTHON" -m venv .venv-xla
fi
PIP=".venv-xla/bin/python -m pip"
if ! .venv-xla/bin/python -c "import torch_xla" 2>/dev/null; then
  $PIP install -q --upgrade pip >/dev/null
  $PIP install -q "torch==2.9.0" "torch-xla==2.9.0"
fi
# The model, data and tokenizer code (no Megatron training, no DeepSpeed): megatron-core only for its dataset
# classes, without its dependencies so that it cannot move torch.
$PIP install -q "numpy>=1.26" "pyyaml>=6" "sentencepiece>=0.2,<0.3" "safetensors>=0.5,<1" "psutil>=5.9" "pytest>=8" \
  "pytest-timeout>=2.3" packaging
$PIP install -q --no-deps "megatron-core==0.16.1"
.venv-xla/bin/python -c "import torch, torch_xla; print(f'xla environment ready: torch {torch.__version__}, torch-xla {torch_xla.__version__}')"
exec env PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -q -p no:cacheprovider tests/xla "$@"
