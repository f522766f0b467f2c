#!/usr/bin/env bash
# Train with torch-xla SPMD on a TPU VM, or on every host of a TPU pod slice (each host runs this same command).
#   bash launch/tpu.sh --config launch/configs/125m-attnres.yaml --mesh 1,8 --bf16 [any mega_depth.train flag]
#   gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all \
#       --command "cd mega_depth && bash launch/tpu.sh --config ... --mesh 4,8 --bf16"
# Flags of the XLA trainer (python -m mega_depth.xla.train --help):
#   --mesh DATA,FSDP      device mesh over all chips: N,1 data parallel (default), 1,N FSDP, D,F both
#   --mat-mul-precision   default | high | highest (highest: fp32-exact matmuls, for parity checks)
#   --bf16                bf16 autocast with fp32 master weights and optimizer state
# Environment: PJRT_DEVICE (TPU here), MEGA_DEPTH_XLA_CACHE=DIR keeps compiled programs across runs,
# PY (the Python with torch==2.9.0 and torch-xla[tpu]==2.9.0; default python3).
# Multi-host: every host reads the same global batch and sends only its own shards; checkpoints (--save) gather
# full tensors on one host, which is supported on a single host only (the trainer refuses --save on a pod).
set -euo pipefail
cd "$(dirname "$0")/.."
export PJRT_DEVICE=${PJRT_DEVICE:-TPU}
exec "${PY:-python3}" -m mega_depth.xla.train "$@"
