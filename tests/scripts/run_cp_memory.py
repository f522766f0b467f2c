"""Bytes one training step's forward saves for backward per rank, at CP1 and at CP2, at the same micro-batch.

Run under torchrun with 2 processes (CP1 is then DP2: each rank trains a whole micro-batch of its own):
    torchrun --nproc-per-node 2 tests/scripts/run_cp_memory.py OUT.json
Writes {mechanism: {"cp1" | "cp2": {"total": bytes, "attention": the core attention's part}}} for rank 0
(mega_depth/kernels/saved_bytes.py). The model is wider than the layout tests' so that the CPU's materialised
causal mask (a GPU's fused kernels have none) stays small beside the activations.
"""

from __future__ import annotations

import json
import os
import sys

import torch

MODEL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "32", "--vocab-size", "128", "--mock-data", "--micro-batch-size", "1", "--train-iters", "1"]
MECHANISMS = {"standard": ["--residual", "standard"], "depth-attention": ["--residual", "depth-attention"],
              "attnres-block": ["--residual", "attnres", "--attnres-num-blocks", "2"]}


def measure(flags, world: int) -> dict:
    from mega_depth.megatron.deferred_fusions import import_megatron

    import_megatron()
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mega_depth.config import parse_args
    from mega_depth.data.datasets import GlobalBatchSampler, build_datasets, tokenizer_for
    from mega_depth.kernels.saved_bytes import saved_bytes_by_region
    from mega_depth.training.backends.megatron import MegatronBackend

    cfg = parse_args(MODEL + flags).validate(world)
    backend = MegatronBackend(cfg)
    backend.build()
    mbs, nmb, dp, dp_rank = backend.sampler_shape
    sampler = GlobalBatchSampler(build_datasets(cfg, tokenizer_for(cfg), (8, None, None))[0], mbs, nmb, dp, dp_rank)
    params = [p for m in backend.model for p in m.parameters()]
    attention = [m for chunk in backend.modules for m in chunk.modules() if isinstance(m, DotProductAttention)]
    saved = saved_bytes_by_region(lambda: backend.forward_backward(sampler.microbatches(0)), params,
                                  {"attention": attention})
    backend.close()
    return saved


def main() -> None:
    out = {}
    world = int(os.environ["WORLD_SIZE"])
    for name, flags in MECHANISMS.items():
        out[name] = {"cp1": measure(flags, world), "cp2": measure(flags + ["--context-parallel-size", "2"], world)}
    if torch.distributed.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
