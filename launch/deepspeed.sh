#!/usr/bin/env bash
# Launch mega_depth's DeepSpeed engine path (ZeRO data parallelism) with the `deepspeed` launcher.
#
#   One node:       NGPUS=8 launch/deepspeed.sh --deepspeed-config launch/ds_configs/zero2.json --config ...
#   Hostfile:       HOSTFILE=launch/hostfile.example launch/deepspeed.sh ...     (ssh/pdsh to every host)
#   Per node (schedulers without ssh): on node i of N, with the same MASTER_ADDR and MASTER_PORT:
#                   NO_SSH=1 NNODES=N NODE_RANK=i MASTER_ADDR=node0 MASTER_PORT=29400 NGPUS=8 launch/deepspeed.sh ...
#     (DeepSpeed's --no_ssh needs a hostfile naming every node: one with NNODES entries of NGPUS slots is written
#     for the launch; only the count and order matter, no host is contacted.)
# --deepspeed is added for you; everything else goes to `python -m mega_depth.train`.
# DeepSpeed's launcher runs through `python -m mega_depth.ds_launcher`: on a SIGTERM the workers get SAVE_GRACE_S
# (default 100; DeepSpeed's own is a fixed 30) to save, and the launch exits 0 when they did (143 otherwise). Over
# ssh (HOSTFILE) DeepSpeed's runner stops the remote workers at once: under a scheduler use NO_SSH=1 per node.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/common.sh
NGPUS=${NGPUS:-$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null || echo 1)}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  export DS_ACCELERATOR=cpu  # CPU: gloo and the CPU accelerator
fi
if [ -n "${HOSTFILE:-}" ]; then
  args=(--hostfile "$HOSTFILE" --no_ssh_check --master_port "$(master_port)")
elif [ -n "${NO_SSH:-}" ]; then
  NNODES=${NNODES:?set NNODES}
  hostfile=$(mktemp "${TMPDIR:-/tmp}/mega_depth_hostfile.XXXXXX")
  trap 'rm -f "$hostfile"' EXIT
  for ((i = 0; i < NNODES; i++)); do echo "node$i slots=$NGPUS"; done > "$hostfile"
  args=(--hostfile "$hostfile" --no_ssh --num_nodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK}"
        --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "$(master_port)")
else
  args=(--num_gpus "$NGPUS" --master_port "$(master_port)")
fi
"$PY" -m mega_depth.ds_launcher "${args[@]}" --module mega_depth.train --deepspeed "$@" &
launcher=$!
# the script stays (its EXIT trap removes the hostfile): a SIGTERM to it goes on to the launcher, and its status
# is the launcher's once the workers have saved, not the 143 of an interrupted wait
trap 'forwarded=1; kill -TERM "$launcher" 2>/dev/null || true' TERM
while :; do
  forwarded=0
  status=0
  wait "$launcher" || status=$?
  [ "$forwarded" = 1 ] || break
done
exit "$status"
