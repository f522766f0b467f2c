#!/usr/bin/env bash
# README command 1: set up, prepare the embedded corpus, train a tiny model, save, export to Hugging Face, sample.
#   bash tools/quickstart.sh                      # AttnRes (Block), on CPU or the one GPU
#   MECH=dca-2 bash tools/quickstart.sh --train-iters 100   # another mechanism; extra flags go to the trainer
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
PY=.venv/bin/python
MECH=${MECH:-attnres}
bash tools/prepare_corpus.sh
RUN=runs/tiny-$MECH
rm -rf "$RUN"  # a fresh run each time (use --load to resume one)
echo "== training $MECH (launch/configs/tiny-$MECH.yaml)"
$PY -m mega_depth.train --config "launch/configs/tiny-$MECH.yaml" "$@"
echo "== exporting to Hugging Face format"
$PY tools/convert_to_hf.py --load "$RUN/checkpoints" --out "$RUN/hf" --force
$PY tools/generate.py "$RUN/hf" --prompt "The Python tutorial"
echo "checkpoints: $RUN/checkpoints   Hugging Face folder: $RUN/hf   TensorBoard: $RUN/tensorboard"
