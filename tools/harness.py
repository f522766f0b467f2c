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


def add_model_args(parser, hidden_size: int, seq_length: int) -> None:
    """The shape flags the check tools share (their defaults differ by what each check needs to see)."""
    parser.add_argument("--hidden-size", type=int, default=hidden_size)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-query-groups", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=seq_length)
    parser.add_argument("--micro-batch-size", type=int, default=2)


def model_flags(args, mechanism: str, train_iters: int, gpu: bool, extra: List[str]) -> List[str]:
    """Trainer flags for one setting from add_model_args' values: mock data, two micro-batches a step, the Triton
    mixing, bf16 on a GPU; `extra` (the tool's unknown flags) last, so they win."""
    from mega_depth.catalogue import mechanism_flags

    return ["--mock-data", "--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers),
            "--num-attention-heads", str(args.num_attention_heads), "--num-query-groups", str(args.num_query_groups),
            "--seq-length", str(args.seq_length), "--vocab-size", "32000", "--micro-batch-size",
            str(args.micro_batch_size), "--global-batch-size", str(2 * args.micro_batch_size), "--train-iters",
            str(train_iters), "--lr-decay-style", "constant", "--mixing-impl", "triton"] \
        + (["--bf16"] if gpu else []) + mechanism_flags(mechanism, args.num_layers) + extra


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
