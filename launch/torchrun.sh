#!/usr/bin/env bash
# Launch mega_depth with torchrun, on one node or several.
#
#   One node:    NPROC=8 launch/torchrun.sh --config launch/configs/125m-attnres.yaml --data-path ...
#   Multi-node:  on every node, with the same MASTER_ADDR/MASTER_PORT and NNODES, and its own NODE_RANK:
#                NNODES=4 NODE_RANK=$i MASTER_ADDR=node0 NPROC=8 launch/torchrun.sh --config ...
# Everything after the script name goes to `python -m mega_depth.train`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
NPROC=${NPROC:-$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null || echo 1)}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')}
exec $PY -m torch.distributed.run --nproc-per-node "$NPROC" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" -m mega_depth.train "$@"
