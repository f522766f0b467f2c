"""`python -m mega_depth.train`: pretrain a depth-mixing LM on Megatron-core (torchrun, the deepspeed launcher, or
one process).

    python -m mega_depth.train --config launch/configs/tiny-attnres.yaml --train-iters 50
    torchrun --nproc-per-node 4 -m mega_depth.train --config ... --tensor-model-parallel-size 2 ...
    deepspeed --num_gpus 8 --module mega_depth.train --deepspeed --deepspeed-config launch/ds_configs/zero2.json ...

Exit status: 0 done (or saved and stopped on SIGTERM / --exit-interval), 2 bad input (one line on stderr naming the
problem and the fix), 3 non-finite loss with --on-nan stop.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, List, Optional

from mega_depth.config import Config, ConfigError, parse_args
from mega_depth.quiet import quiet_known_warnings


def main(argv: Optional[List[str]] = None) -> int:
    quiet_known_warnings()
    try:
        cfg = parse_args(argv)
        apply_tokenizer_vocab(cfg)
        cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))  # before any process group: every rank fails alike
    except ConfigError as e:
        print(f"mega_depth: configuration error: {e}", file=sys.stderr)
        return 2

    def backend():
        if cfg.training.deepspeed:
            from mega_depth.training.backends.deepspeed import DeepSpeedBackend

            return DeepSpeedBackend(cfg)
        from mega_depth.training.backends.megatron import MegatronBackend

        return MegatronBackend(cfg)

    code = train(cfg, backend)
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return code


def train(cfg: Config, make_backend: Callable, prog: str = "mega_depth") -> int:
    """Build the backend, run the trainer, and turn the run's outcome into an exit status (see the module doc)."""
    from mega_depth.training.trainer import NonFiniteLoss, Trainer

    backend = None
    try:
        backend = make_backend()
        Trainer(cfg, backend).run()
        return 0
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except NonFiniteLoss as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 3
    finally:
        if backend is not None:
            backend.close()


def apply_tokenizer_vocab(cfg: Config) -> None:
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


if __name__ == "__main__":
    sys.exit(main())
