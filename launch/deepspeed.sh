#!/usr/bin/env bash
# Launch mega_depth's DeepSpeed engine path (ZeRO data parallelism) with the `deepspeed` launcher.
#
#   One node:       NGPUS=8 launch/deepspeed.sh --deepspeed-config launch/ds_configs/zero2.json --config ...
#   Hostfile:       HOSTFILE=launch/hostfile.example launch/deepspeed.sh ...     (ssh/pdsh to every host)
#   Per node (schedulers without ssh): on node i of N, with the same MASTER_ADDR:
#                   NO_SSH=1 NNODES=N NODE_RANK=i MASTER_ADDR=node0 NGPUS=8 launch/deepspeed.sh ...
# --deepspeed is added for you; everything else goes to `python -m mega_depth.train`.
set -euo pipefail
cd "$(dirname "$0")/.."
DS=${DEEPSPEED:-.venv/bin/deepspeed}
PY=${PYTHON:-.venv/bin/python}
MASTER_PORT=${MASTER_PORT:-29500}
args=(--master_port "$MASTER_PORT")
if [ -n "${HOSTFILE:-}" ]; then
  args+=(--hostfile "$HOSTFILE" --no_ssh_check)
elif [ -n "${NO_SSH:-}" ]; then
  args+=(--no_ssh --nnodes "${NNODES:?set NNODES}" --node_rank "${NODE_RANK:?set NODE_RANK}"
         --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --num_gpus "${NGPUS:-1}")
else
  args+=(--num_gpus "${NGPUS:-$($PY -c 'import torch; print(max(1, torch.cuda.device_count()))')}")
fi
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  export DS_ACCELERATOR=cpu  # CPU: gloo and the CPU accelerator
fi
exec "$DS" "${args[@]}" --module mega_depth.train --deepspeed "$@"
