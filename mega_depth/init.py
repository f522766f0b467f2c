"""Reproducible initialisation shared by the Megatron trainer and the plain (XLA) trainer.

Each random matrix is drawn WHOLE from a generator keyed by (seed, its Megatron parameter name), so every parallel
layout, and the plain model, start from the same weights for the same seed. Norm gains and most depth-mixing
parameters are not random: their initialisation is part of the math and lives in their module's constructor.
A mechanism may still ask for random values (Mechanism.random_init), drawn from the same keyed generators.
"""

from __future__ import annotations

import hashlib
import random
from typing import Optional, Sequence

import numpy as np
import torch

VOCAB_MULTIPLE = 128  # embedding rows are padded to this multiple, independent of TP (like Megatron-LM's default)


def padded_vocab_size(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def keyed_generator(seed: int, megatron_name: str) -> torch.Generator:
    key = int.from_bytes(hashlib.sha256(f"{seed}:{megatron_name}".encode()).digest()[:8], "little")
    return torch.Generator().manual_seed(key)


def initial_value(seed: int, megatron_name: str, full_shape: Sequence[int], init_std: float, num_layers: int,
                  mechanism) -> Optional[torch.Tensor]:
    """The full fp32 initial value of one parameter, named as in the full (TP=1) Megatron model; None when the
    module's constructor already holds it (norm gains, and the mechanism's parameters unless it draws them)."""
    gen = keyed_generator(seed, megatron_name)
    if mechanism.owns(megatron_name):
        return mechanism.random_init(megatron_name, full_shape, gen)
    if len(full_shape) < 2:
        return None
    std = init_std
    if "linear_proj" in megatron_name or "linear_fc2" in megatron_name:
        # Megatron's scaled init for residual-branch outputs (times the mechanism's factor, e.g. HC's sqrt(n))
        std = init_std / (2.0 * num_layers) ** 0.5 * mechanism.output_init_scale()
    return torch.randn(list(full_shape), generator=gen, dtype=torch.float32) * std


def init_plain_model(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Give a plain `mega_depth.model.decoder.CausalLM` exactly the initial weights the Megatron trainer draws for
    the same seed: its parameters go through their Megatron names (fused q/k/v, gate/up) and back."""
    from mega_depth.model.state_dict_adapter import from_canonical, to_canonical

    dc, mechanism = model.cfg, model.model.mechanism
    canonical = {k: v.detach().float() for k, v in model.state_dict().items()}
    if dc.tie_word_embeddings:
        canonical.pop("lm_head.weight", None)
    megatron = from_canonical(canonical, dc)
    for name, value in megatron.items():
        init = initial_value(seed, name, value.shape, init_std, dc.num_layers, mechanism)
        if init is not None:
            megatron[name] = init
    missing, unexpected = model.load_state_dict(to_canonical(megatron, dc), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and dc.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"plain-model init: missing {missing}, unexpected {unexpected}")
