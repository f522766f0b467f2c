"""`python -m mega_depth.train`: pretrain a depth-mixing LM on Megatron-core (torchrun, or one process)."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import torch

from mega_depth.config import ConfigError, parse_args


def main(argv: Optional[List[str]] = None) -> int:
    cfg = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg.validate(world)  # before any process group exists: bad input fails fast, on every rank alike
    except ConfigError as e:
        print(f"mega_depth: configuration error: {e}", file=sys.stderr)
        return 2

    from megatron.core import parallel_state

    from mega_depth.data.datasets import GlobalBatchSampler, build_train_dataset
    from mega_depth.training.loop import train
    from mega_depth.training.setup import init_distributed, setup

    init_distributed()
    state = setup(cfg)
    dp = parallel_state.get_data_parallel_world_size()
    sampler = GlobalBatchSampler(
        build_train_dataset(cfg, cfg.training.train_iters * cfg.training.micro_batch_size * state.num_microbatches
                            * dp),
        cfg.training.micro_batch_size, state.num_microbatches, dp, parallel_state.get_data_parallel_rank(),
    )
    dump = os.environ.get("MEGA_DEPTH_DUMP_GRADS")  # test hook: full grads after step 1, per rank
    on_step = None
    if dump:
        on_step = _grad_dumper(state, dump)
    train(state, sampler, on_step=on_step)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def _grad_dumper(state, path):
    """Save the full gradients of step 1 (kept before the optimizer consumed them) as path/grads_rank<r>.pt."""
    from megatron.core import parallel_state

    from mega_depth.training import loop
    from mega_depth.training.inspect import full_grads

    original_step = state.optimizer.step
    done = {"saved": False}

    def step_and_dump():
        if not done["saved"]:
            grads = full_grads(state.model)
            if parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
                os.makedirs(path, exist_ok=True)
                torch.save(grads, os.path.join(path, f"grads_rank{torch.distributed.get_rank()}.pt"))
            done["saved"] = True
        return original_step()

    state.optimizer.step = step_and_dump
    return None


if __name__ == "__main__":
    sys.exit(main())
