#!/usr/bin/env bash
# Create .venv and install mega_depth with everything it needs. Idempotent: a second run only checks.
# torch goes in first, pinned, so that nothing else can pull a multi-GB CUDA build of torch on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
# megatron-core 0.16.1 is the newest for Python 3.11 (pyproject: >=3.11,<3.12): say so before building a venv
# that cannot take it, and refuse an existing .venv of another Python, which pip would fail on later
python_ok() { "$1" -c 'import sys; sys.exit(not (sys.version_info[:2] == (3, 11)))' 2>/dev/null; }
if [ -x .venv/bin/python ]; then
  if ! python_ok .venv/bin/python; then
    echo "setup: .venv holds Python $(.venv/bin/python -c 'import platform; print(platform.python_version())'), not 3.11: remove it (rm -rf .venv) and rerun with PYTHON=python3.11" >&2
    exit 2
  fi
elif ! python_ok "$PYTHON"; then
  echo "setup: $PYTHON is not Python 3.11 (megatron-core 0.16.1 wants 3.11): install python3.11 or set PYTHON to one" >&2
  exit 2
else
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
PYTHONWARNINGS=ignore $PIP install -q -e ".[test]"  # (setuptools warns about every editable install)
# DeepSpeed after torch (installed first it would pull a CUDA torch), built here with its CPU comm op so that
# init_distributed does not JIT-compile it (~25 s) in every process.
if ! .venv/bin/python -c "import deepspeed" 2>/dev/null; then
  $PIP install -q "setuptools>=70" wheel
  DS_BUILD_SHM_COMM=1 $PIP install -q --no-build-isolation "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
fi
DS_ACCELERATOR=cpu .venv/bin/python -c "import torch, megatron.core, deepspeed; print(f'mega_depth environment ready: torch {torch.__version__}, megatron-core {megatron.core.__version__}, deepspeed {deepspeed.__version__}')" 2>/dev/null
