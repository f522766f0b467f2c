"""`python -m mega_depth.train`: pretrain a depth-mixing LM on Megatron-core (torchrun, or one process).

    python -m mega_depth.train --config launch/configs/tiny-attnres.yaml --train-iters 50
    torchrun --nproc-per-node 4 -m mega_depth.train --config ... --tensor-model-parallel-size 2 ...
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from mega_depth.config import ConfigError, parse_args


def main(argv: Optional[List[str]] = None) -> int:
    try:
        cfg = parse_args(argv)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        _apply_tokenizer_vocab(cfg)
        cfg.validate(world)  # before any process group exists: bad input fails fast, on every rank alike
    except ConfigError as e:
        print(f"mega_depth: configuration error: {e}", file=sys.stderr)
        return 2

    if cfg.training.deepspeed:
        from mega_depth.training.deepspeed_engine import run as run_deepspeed

        return run_deepspeed(cfg)

    import torch

    from mega_depth.training.loop import NonFiniteLoss
    from mega_depth.training.setup import init_distributed, setup

    init_distributed()
    try:
        state = setup(cfg)
        run(state)
    except ConfigError as e:
        print(f"mega_depth: {e}", file=sys.stderr)
        torch.distributed.destroy_process_group()
        return 2
    except NonFiniteLoss as e:
        print(f"mega_depth: {e}", file=sys.stderr)
        torch.distributed.destroy_process_group()
        return 3
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def _apply_tokenizer_vocab(cfg) -> None:
    """With --tokenizer-model the vocabulary comes from the tokenizer; an explicit different --vocab-size is an
    error (it would silently train an embedding that does not match the data)."""
    if cfg.data.tokenizer_model is None:
        return
    from mega_depth.data.tokenizer import SentencePieceTokenizer

    try:
        tok = SentencePieceTokenizer(cfg.data.tokenizer_model)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if cfg.model.vocab_size is not None and cfg.model.vocab_size != tok.vocab_size:
        raise ConfigError(f"--vocab-size {cfg.model.vocab_size} does not match --tokenizer-model "
                          f"{cfg.data.tokenizer_model} ({tok.vocab_size} pieces); drop --vocab-size")
    cfg.model.vocab_size = tok.vocab_size


def run(state) -> list:
    """Data, resume, train. Used by main() and by tools (smoke test, benchmarks)."""
    import torch
    from megatron.core import parallel_state

    from mega_depth.data.datasets import GlobalBatchSampler, MockTokenizer, build_datasets
    from mega_depth.data.tokenizer import SentencePieceTokenizer
    from mega_depth.training import checkpoint
    from mega_depth.training.logger import Logger
    from mega_depth.training.loop import train

    cfg = state.cfg
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    gbs = cfg.training.micro_batch_size * state.num_microbatches * dp
    eval_batches = (cfg.training.train_iters // cfg.data.eval_interval + 1) * cfg.data.eval_iters \
        if cfg.data.eval_interval else 0
    tokenizer = MockTokenizer(cfg.model.vocab_size) if cfg.data.mock_data else \
        SentencePieceTokenizer(cfg.data.tokenizer_model)
    train_ds, valid_ds, _ = build_datasets(cfg, tokenizer, (cfg.training.train_iters * gbs,
                                                            eval_batches * gbs if eval_batches else None, None))
    sampler = GlobalBatchSampler(train_ds, cfg.training.micro_batch_size, state.num_microbatches, dp, dp_rank)
    valid = None
    if cfg.data.eval_interval:
        if valid_ds is None:
            raise ConfigError("--eval-interval needs a validation split: give --split with a non-zero second part")
        # Evaluation always samples the same batches, so validation losses compare across steps and runs.
        valid = GlobalBatchSampler(valid_ds, cfg.training.micro_batch_size, state.num_microbatches, dp, dp_rank)
    start = 0
    if cfg.checkpoint.load:
        start = checkpoint.load(state, cfg.checkpoint.load)
        if torch.distributed.get_rank() == 0:
            print(f"resumed from {cfg.checkpoint.load} at step {start}", flush=True)
    logger = Logger(cfg) if torch.distributed.get_rank() == 0 else None
    try:
        return train(state, sampler, start_step=start, valid_sampler=valid, logger=logger)
    finally:
        if logger is not None:
            logger.close()


if __name__ == "__main__":
    sys.exit(main())
