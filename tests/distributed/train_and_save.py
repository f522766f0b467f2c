"""Train every mechanism a few steps in one layout and save a checkpoint per mechanism (one launch).

    torchrun --nproc-per-node N tests/distributed/train_and_save.py OUT_DIR DATA_PREFIX TOKENIZER [layout flags]
Writes OUT_DIR/<mechanism>/ckpt. The depth-mixing parameters move off their zero/one initialisation.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from run_layout import MECHANISMS  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4",
         "--lr", "1e-2", "--lr-decay-style", "constant", "--split", "100,0,0", "--no-tensorboard", "--seed", "11"]


def main() -> None:
    out, prefix, tokenizer, layout = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    import torch
    from megatron.core import parallel_state

    from mega_depth.config import parse_args
    from mega_depth.train import _apply_tokenizer_vocab, run
    from mega_depth.training.setup import init_distributed, setup

    world = init_distributed()
    only = os.environ.get("MECHANISMS")
    for name, flags in MECHANISMS.items():
        if only and name not in only.split(","):
            continue
        cfg = parse_args(MODEL + flags + layout + ["--data-path", prefix, "--tokenizer-model", tokenizer,
                                                   "--save", os.path.join(out, name, "ckpt"),
                                                   "--output-dir", os.path.join(out, name, "run")])
        _apply_tokenizer_vocab(cfg)
        cfg.validate(world)
        run(setup(cfg))
        parallel_state.destroy_model_parallel()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
