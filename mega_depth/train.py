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
        apply_checkpoint_args(cfg, say=print if os.environ.get("RANK", "0") == "0" else (lambda msg: None))
        apply_tokenizer_vocab(cfg)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if cfg.training.dry_run:  # sized on the meta device at the layout's world, without a process group
            from mega_depth.training.dry_run import dry_run, layout_world

            world_size = layout_world(cfg, world_size)
        cfg.validate(world_size)  # before any process group: every rank fails alike
        if cfg.training.dry_run:
            dry_run(cfg, world_size, say=print if os.environ.get("RANK", "0") == "0" else (lambda msg: None))
            return 0
    except ConfigError as e:
        print(f"mega_depth: configuration error: {e}", file=sys.stderr)
        return 2

    def backend():
        from mega_depth.megatron.deferred_fusions import import_megatron

        import_megatron()  # both backends build Megatron-core's model
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


# The model fields --use-checkpoint-args takes from the checkpoint (its architecture; not how it runs)
def apply_checkpoint_args(cfg: Config, say: Callable[[str], None] = lambda msg: None) -> None:
    """--use-checkpoint-args (Megatron-LM's flag): the model's shape and the mechanism with its options come from
    the --load checkpoint, over the flags and the YAML, so fine-tuning an imported model needs no --config. Reads
    the metadata only (every rank, before any process group); the trainer verifies the checkpoint when it loads."""
    import dataclasses

    from mega_depth.checkpoint.rules import CheckpointError, architecture_model_fields, peek_metadata
    from mega_depth.checkpoint.weights import saved_config

    ck = cfg.checkpoint
    if not ck.use_checkpoint_args:
        return
    if not ck.load:
        raise ConfigError("--use-checkpoint-args takes the model from the --load checkpoint; pass --load")
    try:
        found = peek_metadata(ck.load)
    except CheckpointError as e:
        raise ConfigError(f"--use-checkpoint-args: {e}") from None
    if found is None:
        raise ConfigError(f"--use-checkpoint-args: --load {ck.load} holds no checkpoint yet; drop the flag for a "
                          "fresh run")
    path, meta = found
    if not {"model", "residual"} <= set(meta["config"]):
        raise ConfigError(f"--use-checkpoint-args: {path} records no model or mechanism; pass --config instead")
    saved = saved_config(meta)
    # every field of the architecture record, MoE included (an older checkpoint records fewer)
    recorded = [name for name in architecture_model_fields() if name in meta["config"]["model"]]
    changed = [name for name in recorded if getattr(cfg.model, name) != getattr(saved.model, name)]
    for name in recorded:
        setattr(cfg.model, name, getattr(saved.model, name))
    changed += [f.name for f in dataclasses.fields(saved.residual)
                if getattr(saved.residual, f.name) != getattr(cfg.residual, f.name)]
    cfg.residual = saved.residual
    say(f"--use-checkpoint-args: model and mechanism from {path}" + (f" (set: {', '.join(changed)})" if changed
                                                                     else ""))


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
    if cfg.checkpoint.use_checkpoint_args and cfg.model.vocab_size is not None:
        # the embedding is the checkpoint's; it may be padded past the tokenizer's pieces
        if tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"--tokenizer-model {cfg.data.tokenizer_model} has {tok.vocab_size} pieces, more than "
                              f"the --load checkpoint's vocabulary ({cfg.model.vocab_size}); use the tokenizer "
                              "the model was trained with")
        return
    if cfg.model.vocab_size is not None and cfg.model.vocab_size != tok.vocab_size:
        raise ConfigError(f"--vocab-size {cfg.model.vocab_size} does not match --tokenizer-model "
                          f"{cfg.data.tokenizer_model} ({tok.vocab_size} pieces); drop --vocab-size")
    cfg.model.vocab_size = tok.vocab_size


if __name__ == "__main__":
    sys.exit(main())
