"""What the benchmark tools share: a Megatron-core backend for one setting, with mock data in the same order as
the trainer's (GlobalBatchSampler), built in the current process group (torchrun or one process)."""

from __future__ import annotations

import os
import sys
from typing import List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start() -> int:
    """The process group (gloo on CPU, NCCL on a GPU); returns the world size."""
    from mega_depth.megatron.deferred_fusions import import_megatron
    from mega_depth.quiet import quiet_known_warnings
    from mega_depth.training.distributed import init_process_group

    quiet_known_warnings()
    import_megatron()
    return init_process_group()


def megatron_run(flags: List[str], samples: int) -> Tuple[object, object]:
    """(built MegatronBackend, sampler over `samples` mock samples) for trainer flags."""
    import torch

    from mega_depth.config import parse_args
    from mega_depth.data.datasets import GlobalBatchSampler, build_datasets, tokenizer_for
    from mega_depth.training.backends.megatron import MegatronBackend

    cfg = parse_args(flags).validate(torch.distributed.get_world_size())
    backend = MegatronBackend(cfg)
    backend.build()
    mbs, nmb, dp, dp_rank = backend.sampler_shape
    data = build_datasets(cfg, tokenizer_for(cfg), (samples, None, None))[0]
    return backend, GlobalBatchSampler(data, mbs, nmb, dp, dp_rank)


def train_step(backend, microbatches) -> float:
    """One optimizer step (no NaN policy: benchmarks run finite losses); returns the loss."""
    loss = backend.forward_backward(microbatches)
    backend.update()
    return loss
