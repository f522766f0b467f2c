#!/usr/bin/env bash
# Launch mega_depth with torchrun (through mega_depth.launcher: a SIGTERM save ends with exit 0), one node or many.
#
#   One node:    NPROC=8 launch/torchrun.sh --config launch/configs/125m-attnres.yaml --data-path ...
#   Multi-node:  on every node, with the same MASTER_ADDR, MASTER_PORT and NNODES, and its own NODE_RANK:
#                NNODES=4 NODE_RANK=$i MASTER_ADDR=node0 MASTER_PORT=29400 NPROC=8 launch/torchrun.sh --config ...
# SAVE_GRACE_S (default 100): how long the workers get to save after a SIGTERM before they are killed.
# Everything after the script name goes to `python -m mega_depth.train`.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/common.sh
NPROC=${NPROC:-$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null || echo 1)}
NNODES=${NNODES:-1}
if [ "$NNODES" -gt 1 ]; then
  # defaults here would hang: each node would wait on its own 127.0.0.1, or two nodes would claim rank 0
  for need in "MASTER_ADDR=node 0's address, the same on every node" \
              "NODE_RANK=this node's index, 0 to $((NNODES - 1))"; do
    var=${need%%=*}
    if [ -z "${!var:-}" ]; then
      echo "launch/torchrun.sh: NNODES=$NNODES needs $var set to ${need#*=}" >&2
      exit 2
    fi
  done
fi
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=$(master_port)
exec "$PY" -m mega_depth.launcher --nproc-per-node "$NPROC" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" -m mega_depth.train "$@"
