"""Reproducible initialisation shared by the Megatron trainer and the plain (XLA) trainer.

Each random matrix is drawn WHOLE from a generator keyed by (seed, its Megatron parameter name), so every parallel
layout, and the plain model, start from the same weights for the same seed. Norm gains and depth-mixing
parameters are not random: their initialisation is part of the math (mixing.py).
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence

import numpy as np
import torch

VOCAB_MULTIPLE = 128  # embedding rows are padded to this multiple, independent of TP (like Megatron-LM's default)


def padded_vocab_size(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def is_random_init(name: str, param: torch.Tensor) -> bool:
    """Matrices of linear layers and embeddings; never norms or depth-mixing parameters (their init is the math)."""
    return param.dim() >= 2 and not any(k in name for k in ("_mixer.", "grn"))


def keyed_normal(seed: int, megatron_name: str, full_shape: Sequence[int], init_std: float,
                 num_layers: int) -> torch.Tensor:
    """The full fp32 initial value of one random matrix, named as in the full (TP=1) Megatron model."""
    key = int.from_bytes(hashlib.sha256(f"{seed}:{megatron_name}".encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(key)
    out_std = init_std / (2.0 * num_layers) ** 0.5  # Megatron's scaled init for residual-branch outputs
    scale = out_std if ("linear_proj" in megatron_name or "linear_fc2" in megatron_name) else init_std
    return torch.randn(list(full_shape), generator=gen, dtype=torch.float32) * scale


def init_plain_model(model: torch.nn.Module, dc, seed: int, init_std: float) -> None:
    """Give a plain `mega_depth.model.CausalLM` exactly the initial weights the Megatron trainer draws for the same
    seed: its random matrices go through the Megatron names (fused q/k/v, gate/up) and back."""
    from mega_depth.megatron.state_dict import from_canonical, to_canonical

    canonical = {k: v.detach().float() for k, v in model.state_dict().items()}
    if dc.tie_word_embeddings:
        canonical.pop("lm_head.weight", None)
    megatron = from_canonical(canonical, dc)
    for name, value in megatron.items():
        if is_random_init(name, value):
            megatron[name] = keyed_normal(seed, name, value.shape, init_std, dc.num_layers)
    missing, unexpected = model.load_state_dict(to_canonical(megatron, dc), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and dc.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"plain-model init: missing {missing}, unexpected {unexpected}")
