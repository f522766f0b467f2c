"""Train every mechanism for a few steps in one parallel layout; write losses, step-1 grads and hop widths.

Run under torchrun (one launch per layout, all mechanisms inside it, so imports are paid once):
    torchrun --nproc-per-node N tests/distributed/run_layout.py OUT_DIR [layout flags...]
Writes OUT_DIR/<mechanism>/losses.json (rank 0), OUT_DIR/<mechanism>/grads_rank<r>.pt (TP rank 0 and DP rank 0
of each stage) and OUT_DIR/<mechanism>/hops.json (hop widths seen by each rank).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from mega_depth.catalogue import MECHANISMS as NAMES, mechanism_flags  # noqa: E402

# 4 layers: 3 AttnRes blocks so that a block straddles a stage boundary; Depth-Attention stride 2, window 1.
MECHANISMS = {name: mechanism_flags(name, 4, attnres_num_blocks=3) for name in NAMES}
# A small GQA model (4 query heads, 2 key-value groups) so TP=2 splits the groups too.
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "16", "--vocab-size", "128", "--train-iters", "3", "--lr", "3e-3", "--seed", "7",
         "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4"]


def main() -> None:
    out_dir, layout = sys.argv[1], sys.argv[2:]
    from megatron.core import parallel_state

    from mega_depth.config import parse_args
    from mega_depth.data.datasets import GlobalBatchSampler, build_train_dataset
    from mega_depth.megatron import providers
    from mega_depth.training.inspect import full_grads
    from mega_depth.training.loop import train_step
    from mega_depth.training.setup import init_distributed, setup

    only = os.environ.get("MECHANISMS")
    world = init_distributed()
    rank = torch.distributed.get_rank()
    for name, flags in MECHANISMS.items():
        if only and name not in only.split(","):
            continue
        cfg = parse_args(MODEL + flags + layout).validate(world)
        cfg.logging.output_dir = os.path.join(out_dir, name)
        state = setup(cfg)
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        sampler = GlobalBatchSampler(build_train_dataset(cfg, 64), cfg.training.micro_batch_size,
                                     state.num_microbatches, dp, dp_rank)
        step_opt = state.optimizer.step
        grads = {}

        def step_with_dump():  # keep step 1's full grads before the optimizer consumes them
            if not grads:
                grads.update(full_grads(state.model))
            return step_opt()

        state.optimizer.step = step_with_dump
        losses, hops = [], {}
        for step in range(cfg.training.train_iters):
            losses.append(train_step(state, sampler.microbatches(step))["loss"])
            if step == 0:  # {to_stage: [width per token, bytes per micro-batch]}
                counter = providers.HOP_COUNTER
                hops = {str(k): [counter.widths[k], counter.bytes[k][0]] for k in counter.widths}
        os.makedirs(cfg.logging.output_dir, exist_ok=True)
        if dp_rank == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
            torch.save(grads, os.path.join(cfg.logging.output_dir, f"grads_rank{rank}.pt"))
            with open(os.path.join(cfg.logging.output_dir, f"hops_rank{rank}.json"), "w") as f:
                json.dump(hops, f)
        if rank == 0:
            with open(os.path.join(cfg.logging.output_dir, "losses.json"), "w") as f:
                json.dump(losses, f)
        parallel_state.destroy_model_parallel()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
