#!/usr/bin/env bash
# The single-GPU checks behind docs/benchmarks.md, as one prepared, time-boxed run (GPU time is scarce), most
# important first, so that the first 95 s give our kernels' table and the next 200 s the 1B step ratios:
#   1. environment;
#   2. every mixing op alone at the 1B step's sizes, forward and backward, against a copy of the same bytes
#      (tools/bench_kernels.py --passes ours): our rows of the kernel table, with where each call's host time went
#      (--host-profile: on 2026-11-30, second session, every op of ours took as long to issue as to run) and each
#      phase's kernels with their device times (--kernel-breakdown: which of an op's kernels holds its time);
#   3. throughput at the 1B-class size (24 layers, d = 2048, 16 heads / 8 groups, seq 2048): the baseline on the
#      SDPA local spec, the speed targets' mechanisms with --mixing-impl triton (Block AttnRes, Depth-Attention and
#      2-DCA first), same run, interleaved, one mechanism and the baseline resident at a time; MFU,
#      saved-for-backward bytes, the analytic bound;
#   4. the step captured as one CUDA graph (--cuda-graph-impl local, never run on a GPU before this script's
#      first run of it): tools/graph_check.py trains every setting at d = 256 eagerly and captured and compares
#      the losses and gradient norms step by step and the weights' updates; then the 1B ratios of Block AttnRes
#      and Depth-Attention (MECHS_1B_GRAPHED) with the baseline captured too, where the host no longer issues the
#      step kernel by kernel;
#   5. the published peers on the same ops, each checked equal to ours first, then torch.compile of the eager math
#      (--passes peers,torch.compile): the rest of the kernel table. Their first compiles and autotuning take
#      minutes on a fresh machine (fla tries 24 settings a kernel), which is why they follow the ratios.
#   FULL=1 adds: the ops whose loops pipeline their loads with those loops waiting on each step's loads instead
#   (MEGA_DEPTH_KERNELS_PIPELINE=0: kernels_unpipelined, beside step 2's rows); the kernels' tests on the GPU (bf16
#   and the layouts that read views in place, against the eager math; 12 passed in every run since 2026-11-29); a
#   torch.profiler trace of one 1B-size step, the baseline and
#   PROFILE_MECHS (top kernels, each mixing kernel's device time and launches, the kernels that differ most from
#   the baseline's, device idle time: tools/profile_step.py); host syncs (one training step of every mechanism
#   under torch.cuda.set_sync_debug_mode("error"), tools/sync_check.py; 0 in every GPU run since 2026-11-27, and
#   the CPU suite checks it); the kernels' launch settings tuned at the 1B sizes (tools/bench_kernels.py --tune:
#   tuned.json in the results, to commit as mega_depth/kernels/tuned.json) and our rows again with them
#   (ONLY=tune_kernels,kernels_tuned FULL=1 runs those two alone, ~190 s), throughput at d = 512 (12 layers, every
#   mechanism), --compile-layers at d = 512 (Block AttnRes and its baseline, each layer compiled whole), the
#   quickstart's train -> export -> sample, a short GPU quality run and the mixing's cost on MoE layers at the 1B
#   class (ONLY=throughput_moe FULL=1 runs that alone; past the 580 s box). The boxes are sized from the last GPU
#   runs (H200, 2026-11-29 and -30, docs/benchmarks.md): a 1B pair takes 38-70 s (230 s gave six settings of seven
#   on 2026-11-30, second session; 200 s gives five), our kernels' rows ~22 s after ~15 s of imports (the device
#   times from CUDA graphs of the calls add a guess of 10 s), the peers' 62 s for the AttnRes mix alone, a
#   profiled setting ~33 s, the tuner 131 s for 35 kernels; the graph check is a guess (7 settings at d = 256,
#   two short runs each).
#   WHEELS=wheels OUT=results bash tools/device_check.sh   # on the GPU machine (PY=python3 there; carry the
#                         # megatron-core, liger-kernel, fla-core and flash-attn-res wheels: no internet there)
#   ONLY=throughput_1b MECHS_1B=dca-2,mhc OUT=results bash tools/device_check.sh   # a rerun of chosen steps
#   SCALE=tiny OUT=/tmp/dc bash tools/device_check.sh   # the same steps at toy sizes, as a dry run on CPU
# Every step runs under its own timeout and the script goes on after a failure; the summary lists each step's exit
# status; the timeouts add up to 580 s (one 600 s device command). Results: $OUT/device_check.tar.gz (JSON, markdown,
# logs, summary.txt) and $OUT/device_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/device_check}
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PY
SUMMARY=""
# WHEELS=dir: wheels carried to a machine without internet (megatron-core, liger-kernel), installed without deps
if [ -n "${WHEELS:-}" ]; then "$PY" -m pip install -q --no-deps "$WHEELS"/*.whl; fi

step() {  # step NAME TIMEOUT_S command...
  local name=$1 limit=$2 start rc
  shift 2
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
  echo "== $name: $*"
  start=$(date +%s)
  timeout "$((limit * BOX_SCALE))" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  tail -n 16 "$WORK/$name.log"
  SUMMARY+="$name: exit $rc in $(($(date +%s) - start)) s"$'\n'
  echo "== $name: exit $rc in $(($(date +%s) - start)) s"
  pack  # after every step, so a run cut short still returns what it finished
}

pack() {
  mkdir -p "$WORK/pack"
  cp "$WORK"/*.json "$WORK"/*.log "$WORK"/*.md "$WORK/pack/" 2>/dev/null
  cp "$WORK"/quality/*.png "$WORK"/quality/quality.json "$WORK/pack/" 2>/dev/null
  printf "%s" "$SUMMARY" >"$WORK/pack/summary.txt"
  tar czf "$OUT/device_check.tar.gz" -C "$WORK/pack" .
}

TARGETS=standard,attnres-block,depth-attention,dca-2,dca,attnres-full,mhc
if [ "${SCALE:-full}" = tiny ]; then
  SYNC=(--hidden-size 32 --num-layers 2 --num-attention-heads 4 --num-query-groups 2 --seq-length 32)
  TP_SMALL=(--hidden-size 32 --num-layers 2 --seq-length 32 --steps 1 --rounds 1)
  TP_LARGE=(--hidden-size 64 --num-layers 2 --num-attention-heads 4 --seq-length 64 --steps 1 --rounds 1
            --mechanisms "$TARGETS")
  PROFILE=(--hidden-size 64 --num-layers 2 --num-attention-heads 4 --num-query-groups 2 --seq-length 64
           --micro-batch-size 2)
  QUALITY=(--num-layers 2 --hidden-size 32 --train-iters 8 --eval-iters 2 --seeds 0 --jobs 2)
  TP_MOE=(--hidden-size 64 --num-layers 4 --seq-length 64 --micro-batch-size 2 --steps 1 --rounds 1
          --mechanisms attnres-block --num-experts 4 --moe-layer-freq "([0]*1+[1]*3)")
  QUICK=(--train-iters 10 --eval-interval 5 --lr-warmup-iters 2)
  KERNELS=(--toy --ops attnres_mix,attnres_block)
  UNPIPELINED_OPS=attnres_mix,attnres_block
  # the kernels' tests are collected, not run: the CPU suite runs all of them under the interpreter
  # (tests/unit/test_kernels.py); collecting checks the selection and imports (pytest exits 5 on an empty one)
  KERNEL_TESTS=(--collect-only)
  GRAPH_CHECK=(--hidden-size 32 --num-layers 2 --num-attention-heads 4 --num-query-groups 2 --seq-length 32
               --mechanisms standard,attnres-block,mhc)
  TP_LARGE_GRAPHED=("${TP_LARGE[@]}" --mechanisms attnres-block)
  GRAPHED=()  # a CPU captures nothing: the dry run times the eager step (graph_check's stands a capture in)
  INTERPRET=1
  # the boxes are the GPU's; a 2-core CPU that shares its cores with other tests needs more (the environment's
  # imports alone took 21 s there)
  BOX_SCALE=3
else
  SYNC=()
  # the speed issue's targets first: a pair's numbers reach the JSON as soon as it finishes, so a step cut short by
  # its timeout still reports them
  TP_SMALL=(--hidden-size 512 --num-layers 12 --seq-length 1024 --micro-batch-size 8 --steps 5 --rounds 3
            --mechanisms "$TARGETS,attnres-input-query,hc,denseformer")
  # the 1B class: micro-batch 4 at seq 2048 leaves room for the baseline and one mechanism on an 80 GB card
  TP_LARGE=(--hidden-size 2048 --num-layers 24 --num-attention-heads 16 --num-query-groups 8 --seq-length 2048
            --micro-batch-size 4 --steps 3 --rounds 2 --mechanisms "${MECHS_1B:-$TARGETS}")
  PROFILE=(--hidden-size 2048 --num-layers 24 --num-attention-heads 16 --num-query-groups 8 --seq-length 2048
           --micro-batch-size 4)
  QUALITY=(--num-layers 8 --hidden-size 256 --seq-length 256 --global-batch-size 32 --micro-batch-size 32
           --train-iters 150 --lr 2e-3 --seeds 0 --jobs 10)
  # MoE at the 1B class: 16 experts, top-4, expert width 1408 (about the dense 1B's active MLP), a dense first layer
  TP_MOE=(--hidden-size 2048 --num-layers 24 --num-attention-heads 16 --num-query-groups 8 --seq-length 2048
          --micro-batch-size 2 --steps 3 --rounds 2 --mechanisms attnres-block,mhc --num-experts 16 --moe-router-topk 4
          --moe-ffn-hidden-size 1408 --moe-layer-freq "([0]*1+[1]*23)" --moe-aux-loss-coeff 0.001)
  QUICK=()
  KERNELS=(--shapes 1b)
  # the ops whose loops pipeline their loads since 2026-12-07 (second session); mHC's projection backward (the
  # streams' sum with phi's gradient, also in mhc_sublayer) since 2026-12-08
  UNPIPELINED_OPS=attnres_mix,attnres_block,attnres_block_last,phase2_normed,grn,mhc_sublayer,mhc_projection
  KERNEL_TESTS=()
  GRAPH_CHECK=()
  TP_LARGE_GRAPHED=("${TP_LARGE[@]}" --mechanisms "${MECHS_1B_GRAPHED:-attnres-block,depth-attention}")
  GRAPHED=(--cuda-graph-impl local --cuda-graph-warmup-steps 1)
  INTERPRET=0
  BOX_SCALE=1
fi

# the carried packages' versions from their metadata: importing megatron-core and transformers took past 20 s
step environment 15 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null;
  $PY -c 'import sys, torch, triton; from importlib.metadata import version as v; print(sys.version.split()[0],
  torch.__version__, torch.cuda.is_available(), \"triton\", triton.__version__, *(p + \" \" + v(p) for p in
  (\"megatron-core\", \"transformers\", \"liger-kernel\", \"fla-core\", \"flash-attn-res\")))'"
# (on a CPU, --toy runs the Triton kernels under the interpreter; the JSON is written after every op.) Our rows
# first, alone: 22 s of kernels on the H200 of 2026-11-30 (second session), where the peers' first compiles and
# autotuning (fla tries 24 settings a kernel) took 62 s for the AttnRes mix alone and cut the whole table at 150 s;
# the step took 38 s for 11 ops on 2026-12-04. Since: 14 ops (full DCA's GRN, and the mHC sublayer's two cases,
# which compile about eight kernels more) and each phase's kernels under the profiler, a guess of 20 s more; 10 s of
# the peers' box, which closed on the AttnRes mix's peers then, pays for it
step bench_kernels 80 env TRITON_INTERPRET=$INTERPRET MEGA_DEPTH_KERNELS_FORCE_TRITON=1 \
  "$PY" tools/bench_kernels.py "${KERNELS[@]}" --passes ours --host-profile --kernel-breakdown \
  --out "$WORK/kernels.json" --markdown
step throughput_1b 200 "$PY" tools/bench_throughput.py "${TP_LARGE[@]}" --mixing-impl triton \
  --out "$WORK/throughput_1b.json"
# the peers and the torch.compile floor, beside our rows of the first step (the table merges the two JSONs)
# the step captured as one CUDA graph (--cuda-graph-impl local): first that it trains as the eager step does, every
# setting at a small size, then the 1B ratios with the baseline captured too (the host's share of the step gone)
step graph_check 50 "$PY" tools/graph_check.py "${GRAPH_CHECK[@]}" --out "$WORK/graph_check.json"
step throughput_1b_graphed 120 "$PY" tools/bench_throughput.py "${TP_LARGE_GRAPHED[@]}" --mixing-impl triton \
  "${GRAPHED[@]}" --out "$WORK/throughput_1b_graphed.json"
step kernel_peers 115 env TRITON_INTERPRET=$INTERPRET MEGA_DEPTH_KERNELS_FORCE_TRITON=1 \
  "$PY" tools/bench_kernels.py "${KERNELS[@]}" --passes peers,torch.compile --out "$WORK/kernel_peers.json" \
  --markdown
if [ "${FULL:-0}" = 1 ]; then
  # the ops whose loops pipeline their loads, again with every loop waiting on its own loads (the kernels as they
  # were before: MEGA_DEPTH_KERNELS_PIPELINE=0), beside the first step's rows of the same run: what pipelining gained
  step kernels_unpipelined 45 env TRITON_INTERPRET=$INTERPRET MEGA_DEPTH_KERNELS_FORCE_TRITON=1 \
    MEGA_DEPTH_KERNELS_PIPELINE=0 "$PY" tools/bench_kernels.py "${KERNELS[@]}" --ops "$UNPIPELINED_OPS" \
    --passes ours --kernel-breakdown --out "$WORK/kernels_unpipelined.json" --markdown
  step kernels 35 "$PY" -m pytest -q -p no:cacheprovider tests/kernels -k "bf16 or strided or expanded or chained" \
    "${KERNEL_TESTS[@]}"
  step profile_1b 100 "$PY" tools/profile_step.py "${PROFILE[@]}" --mechanisms "${PROFILE_MECHS:-dca-2,mhc}" \
    --mixing-impl triton --out-dir "$WORK"
  # the tuner starts from the shipped table (its entries are the settings it searches around) and merges its
  # winners into a copy; kernels_tuned then measures the table with that copy, before anyone commits it
  cp mega_depth/kernels/tuned.json "$WORK/tuned.json"
  # no sync in a step of any setting: 0 in every GPU run since 2026-11-27 (the CPU suite checks it on every change)
  step sync_check 50 "$PY" tools/sync_check.py "${SYNC[@]}" --out "$WORK/sync_check.json"
  step tune_kernels 150 env TRITON_INTERPRET=$INTERPRET MEGA_DEPTH_KERNELS_FORCE_TRITON=1 \
    "$PY" tools/bench_kernels.py "${KERNELS[@]}" --tune "$WORK/tuned.json"
  step kernels_tuned 60 env TRITON_INTERPRET=$INTERPRET MEGA_DEPTH_KERNELS_FORCE_TRITON=1 \
    MEGA_DEPTH_TUNED_TABLE="$WORK/tuned.json" "$PY" tools/bench_kernels.py "${KERNELS[@]}" --passes ours \
    --out "$WORK/kernels_tuned.json" --markdown
  step throughput_d512 80 "$PY" tools/bench_throughput.py "${TP_SMALL[@]}" --mixing-impl triton \
    --out "$WORK/throughput_d512.json"
  step throughput_d512_compiled 50 "$PY" tools/bench_throughput.py "${TP_SMALL[@]}" --mixing-impl triton \
    --mechanisms attnres-block --compile-layers --out "$WORK/throughput_d512_compiled.json"
  step quickstart 60 bash -c "bash tools/prepare_corpus.sh && rm -rf runs/tiny-attnres && $PY -m mega_depth.train \
    --config launch/configs/tiny-attnres.yaml ${QUICK[*]} && $PY tools/convert_to_hf.py --load \
    runs/tiny-attnres/checkpoints --out runs/tiny-attnres/hf --force && $PY tools/generate.py runs/tiny-attnres/hf \
    --prompt 'The Python tutorial'"
  step quality 60 "$PY" tools/bench_quality.py "${QUALITY[@]}" --out-dir "$WORK/quality"
  step throughput_moe 150 "$PY" tools/bench_throughput.py "${TP_MOE[@]}" --mixing-impl triton \
    --out "$WORK/throughput_moe.json"
fi

printf "%s" "$SUMMARY" | tee "$OUT/device_check.log"
rm -rf "$WORK"
