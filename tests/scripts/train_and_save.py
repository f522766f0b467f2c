"""Train every mechanism a few steps in one layout and save a checkpoint per mechanism (one launch).

    torchrun --nproc-per-node N tests/scripts/train_and_save.py OUT_DIR DATA_PREFIX TOKENIZER [layout flags]
Writes OUT_DIR/<mechanism>/ckpt. The depth-mixing parameters move off their zero/one initialisation.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fixtures import SAVE_MODEL, mechanism_flags  # noqa: E402


def main() -> None:
    out, prefix, tokenizer, layout = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    import torch

    from mega_depth.megatron.deferred_fusions import import_megatron

    import_megatron()
    from mega_depth.config import parse_args
    from mega_depth.train import apply_tokenizer_vocab, train
    from mega_depth.training.backends.megatron import MegatronBackend

    only = os.environ.get("MECHANISMS")
    for name, flags in mechanism_flags(4).items():
        if only and name not in only.split(","):
            continue
        cfg = parse_args(SAVE_MODEL + flags + layout + ["--data-path", prefix, "--tokenizer-model", tokenizer,
                                                        "--save", os.path.join(out, name, "ckpt"),
                                                        "--output-dir", os.path.join(out, name, "run")])
        apply_tokenizer_vocab(cfg)
        cfg.validate(int(os.environ["WORLD_SIZE"]))
        if train(cfg, lambda: MegatronBackend(cfg)) != 0:
            raise SystemExit(f"{name}: training failed")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
