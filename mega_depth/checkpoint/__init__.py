"""Checkpoints of every trainer (Megatron-core, DeepSpeed, plain/XLA), under one directory convention:

    --save DIR/
      iter_0000010/                      one complete checkpoint
        mega_depth.json                  format, step, run id, config (what --load checks, what export reads)
        manifest.json                    every file's size and sha256, the run id and the config hash
        ...                              the format's own files (dist-checkpoint shards, DeepSpeed states, ...)
      latest_checkpointed_iteration.txt  the step of the newest complete checkpoint

Modules, one job each:
- rules.py: the rules written once for every trainer (atomic save, verification and fall-back, quarantine of
  damaged checkpoints, pruning only the run's own checkpoints, refusing a stale folder, a full disk named);
- manifest.py: each checkpoint's manifest (sizes and sha256) and its verification;
- lock.py: one writer per --save folder (a lock file with a heartbeat);
- weights.py: any format's weights in canonical names, in one process, without a Megatron model;
- plain.py: the plain/XLA trainer's format (safetensors + a pickle-free trainer state) and weights-only
  checkpoints (what an import writes);
- dist_writer.py: megatron-core's dist-checkpoint writes on the trainer's own threads (no forked writer, no helper).
"""
