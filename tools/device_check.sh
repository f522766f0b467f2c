#!/usr/bin/env bash
# The single-GPU checks behind docs/benchmarks.md, as one prepared run (GPU time is scarce):
# environment, smoke test, throughput at two sizes, the quickstart's train -> export -> sample, a quality run.
#   OUT=results bash tools/device_check.sh      # on the GPU machine (PY=python3 there; needs data/processed/)
#   SCALE=tiny OUT=/tmp/dc bash tools/device_check.sh   # the same steps at toy sizes, as a dry run on CPU
# Every step runs under its own timeout and the script goes on after a failure; the summary lists each step's
# exit status; the step timeouts add up to 600 s. Results: $OUT/device_check.tar.gz (JSON, PNG, logs, summary.txt)
# and $OUT/device_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/device_check}
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PY
SUMMARY=""

step() {  # step NAME TIMEOUT_S command...
  local name=$1 limit=$2 start rc
  shift 2
  echo "== $name: $*"
  start=$(date +%s)
  timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  grep -v -e "Warning" -e "warnings.warn" -e "Unable to save" "$WORK/$name.log" | tail -n 14
  SUMMARY+="$name: exit $rc in $(($(date +%s) - start)) s"$'\n'
  echo "== $name: exit $rc in $(($(date +%s) - start)) s"
  pack  # after every step, so a run cut short still returns what it finished
}

pack() {
  mkdir -p "$WORK/pack"
  cp "$WORK"/*.json "$WORK"/*.log "$WORK/pack/" 2>/dev/null
  cp "$WORK"/quality/*.png "$WORK"/quality/quality.json "$WORK/pack/" 2>/dev/null
  printf "%s" "$SUMMARY" >"$WORK/pack/summary.txt"
  tar czf "$OUT/device_check.tar.gz" -C "$WORK/pack" .
}

if [ "${SCALE:-full}" = tiny ]; then
  SMOKE=(--steps 3 --num-layers 2 --hidden-size 32 --seq-length 32)
  TP_SMALL=(--hidden-size 32 --num-layers 2 --seq-length 32 --steps 1 --rounds 1)
  TP_LARGE=(--hidden-size 64 --num-layers 2 --seq-length 32 --steps 1 --rounds 1)
  QUALITY=(--num-layers 2 --hidden-size 32 --train-iters 8 --eval-iters 2 --seeds 0,1 --jobs 2)
  QUICK=(--train-iters 10 --eval-interval 5 --lr-warmup-iters 2)
else
  SMOKE=(--steps 30 --num-layers 8 --hidden-size 512 --seq-length 512 --micro-batch-size 8)
  TP_SMALL=(--hidden-size 512 --num-layers 12 --seq-length 1024 --micro-batch-size 8 --steps 10 --rounds 3)
  TP_LARGE=(--hidden-size 1024 --num-layers 24 --num-attention-heads 16 --seq-length 1024 --micro-batch-size 8
            --steps 10 --rounds 3)
  # The corpus holds ~0.8M tokens: 200 x 32 x 256 = 1.6M tokens is two epochs; three seeds, six runs at a time.
  QUALITY=(--num-layers 12 --hidden-size 256 --seq-length 256 --global-batch-size 32 --micro-batch-size 32
           --train-iters 200 --lr 2e-3 --seeds 0,1,2 --jobs 6)
  QUICK=()
fi

step environment 20 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null;
  $PY -c 'import sys, torch, megatron.core, transformers; print(sys.version.split()[0], torch.__version__,
  megatron.core.__version__, transformers.__version__, torch.cuda.is_available())'"
step smoke 100 "$PY" tools/smoke_test.py "${SMOKE[@]}" --out "$WORK/smoke.json"
step throughput_d512 100 "$PY" tools/bench_throughput.py "${TP_SMALL[@]}" --out "$WORK/throughput_d512.json"
step throughput_d1024 130 "$PY" tools/bench_throughput.py "${TP_LARGE[@]}" --out "$WORK/throughput_d1024.json"
step quickstart 100 bash -c "rm -rf runs/tiny-attnres && $PY -m mega_depth.train --config launch/configs/tiny-attnres.yaml \
  ${QUICK[*]} && $PY tools/convert_to_hf.py --load runs/tiny-attnres/checkpoints --out runs/tiny-attnres/hf --force \
  && $PY tools/generate.py runs/tiny-attnres/hf --prompt 'The Python tutorial'"
step quality 150 "$PY" tools/bench_quality.py "${QUALITY[@]}" --out-dir "$WORK/quality"

printf "%s" "$SUMMARY" | tee "$OUT/device_check.log"
rm -rf "$WORK"
