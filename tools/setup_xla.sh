#!/usr/bin/env bash
# Create .venv-xla, the TPU path's environment: torch 2.9.0 and torch-xla 2.9.0 (torch-xla 2.9.0 requires exactly
# torch 2.9.0; PyPI's is the CUDA build, ~4 GB of wheels, which runs on CPU), and the model, data and tokenizer code's
# dependencies (no Megatron training, no DeepSpeed). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
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
# megatron-core only for its dataset classes, without its dependencies so that it cannot move torch.
$PIP install -q "numpy>=1.26" "pyyaml>=6" "sentencepiece>=0.2,<0.3" "safetensors>=0.5,<1" "psutil>=5.9" "pytest>=8" \
  "pytest-timeout>=2.3" packaging
$PIP install -q --no-deps "megatron-core==0.16.1"
.venv-xla/bin/python -c "import torch, torch_xla; print(f'xla environment ready: torch {torch.__version__}, torch-xla {torch_xla.__version__}')"
