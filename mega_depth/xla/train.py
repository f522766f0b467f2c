"""`python -m mega_depth.xla.train`: train a mega_depth model on XLA devices (TPU; the CPU PJRT device in tests).

    PJRT_DEVICE=TPU python -m mega_depth.xla.train --config launch/configs/125m-attnres.yaml --mesh 1,8 --bf16
    python -m mega_depth.xla.train --device cpu --config ...      # the same trainer, eager, no torch-xla

Same config system, data, tokenizer, initial weights (keyed by seed, like the Megatron trainer), LR schedule and
metrics.jsonl as `python -m mega_depth.train`; the model is the plain one (mega_depth/model/decoder.py) under SPMD:
`--mesh DATA,FSDP` (sharding.py). --micro-batch-size is per batch shard, as Megatron's is per data-parallel rank;
the step's loss is the mean over (micro-batch, shard) of each one's token-mean, as in the Megatron trainer.
Megatron-only options (tensor/pipeline parallelism, DeepSpeed, recomputation, the distributed optimizer) are
refused: sharding is the mesh's job here.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from mega_depth.config import ConfigError, parse_args
from mega_depth.quiet import quiet_known_warnings
from mega_depth.train import apply_checkpoint_args, apply_tokenizer_vocab, train

INSTALL_HINT = ("torch-xla is not installed. On a TPU VM: pip install torch==2.9.0 'torch-xla[tpu]==2.9.0' "
                "(see launch/tpu.sh); on CPU for tests: bash tools/test_xla.sh. Or run this trainer eagerly with "
                "--device cpu.")


def _parse(argv: Optional[List[str]]):
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--device", choices=("xla", "cpu"), default="xla")
    parser.add_argument("--mesh", default=None, help="DATA,FSDP device mesh (default: all devices data parallel)")
    parser.add_argument("--mat-mul-precision", choices=("default", "high", "highest"), default="default")
    own, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        print("XLA options: --device {xla,cpu}  --mesh DATA,FSDP  --mat-mul-precision {default,high,highest}\n"
              "All other flags: python -m mega_depth.train --help")
        raise SystemExit(0)
    return own, parse_args(rest)


def _refuse_megatron_only(cfg) -> None:
    p, t = cfg.parallel, cfg.training
    bad = [flag for flag, on in (
        ("--tensor-model-parallel-size", p.tensor_model_parallel_size > 1),
        ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size > 1),
        ("--context-parallel-size", p.context_parallel_size > 1),
        ("--expert-model-parallel-size", p.expert_model_parallel_size > 1),
        ("--num-layers-per-virtual-pipeline-stage", p.num_layers_per_virtual_pipeline_stage is not None),
        ("--sequence-parallel", p.sequence_parallel), ("--use-distributed-optimizer", p.use_distributed_optimizer),
        ("--recompute-granularity", p.recompute_granularity is not None), ("--deepspeed", t.deepspeed),
        ("--mixing-impl", cfg.model.mixing_impl not in (None, "eager")),
        ("--compile-layers", cfg.model.compile_layers), ("--cuda-graph-impl", t.cuda_graph_impl != "none")) if on]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: Megatron-trainer options, not used by the XLA trainer; shard with "
                          "--mesh DATA,FSDP instead")


def main(argv: Optional[List[str]] = None) -> int:
    quiet_known_warnings()
    try:
        own, cfg = _parse(argv)
        _refuse_megatron_only(cfg)
        apply_checkpoint_args(cfg, say=print)
        apply_tokenizer_vocab(cfg)
    except ConfigError as e:
        print(f"mega_depth.xla: configuration error: {e}", file=sys.stderr)
        return 2
    if own.device == "xla":
        try:
            import torch_xla  # noqa: F401
            import torch_xla.runtime as xr
        except ImportError:
            print(f"mega_depth.xla: {INSTALL_HINT}", file=sys.stderr)
            return 2
        xr.use_spmd()  # before any tensor reaches the device
        if os.environ.get("MEGA_DEPTH_XLA_CACHE"):
            xr.initialize_cache(os.environ["MEGA_DEPTH_XLA_CACHE"], readonly=False)
        if xr.process_count() > 1 and cfg.checkpoint.save:
            print("mega_depth.xla: configuration error: --save on a multi-host pod is not supported yet (checkpoints "
                  "gather full tensors on one host); train without --save there, or on a single host",
                  file=sys.stderr)
            return 2
        if own.mat_mul_precision != "default":
            import torch_xla.backends

            torch_xla.backends.set_mat_mul_precision(own.mat_mul_precision)
    elif own.mesh is not None:
        print("mega_depth.xla: configuration error: --mesh needs --device xla", file=sys.stderr)
        return 2

    def backend():
        from mega_depth.xla.backend import PlainBackend

        return PlainBackend(cfg, own.device, own.mesh)

    return train(cfg, backend, prog="mega_depth.xla")


if __name__ == "__main__":
    sys.exit(main())
