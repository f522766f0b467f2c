"""Checkpoints of every trainer (Megatron-core, DeepSpeed, plain/XLA), under one directory convention:

    --save DIR/
      iter_0000010/                      one complete checkpoint
        mega_depth.json                  format, step, run id, config (what --load checks, what export reads)
        manifest.json                    every file's size and sha256, the run id and the config hash
        ...                              the format's own files (dist-checkpoint shards, DeepSpeed states, ...)
      latest_checkpointed_iteration.txt  the step of the newest complete checkpoint

rules.py holds the rules written once for all trainers (atomic save, verification and fall-back, pruning only the
run's own checkpoints, refusing a stale folder); weights.py reads any format's weights in canonical names, pure
torch; plain.py is the plain trainer's format (safetensors + a pickle-free trainer state).
"""
