"""Weights-only checkpoints in the plain format: model.safetensors in canonical names plus mega_depth.json with
"model_only": true. tools/convert_from_hf.py writes them from Hugging Face folders or other trainers' checkpoints;
every trainer's --load starts from them at step 0 with a new optimizer, in any layout."""

from __future__ import annotations

import os
import shutil
from typing import Dict, Optional

import torch

from mega_depth.checkpoint import rules
from mega_depth.config import Config, ConfigError
from mega_depth.init import padded_vocab_size

WEIGHTS = "model.safetensors"


class SingleProcess:
    """The collectives of one process (or one SPMD program): rules.save's, and the XLA backend's."""

    rank, world_size = 0, 1

    def barrier(self) -> None:
        pass

    def broadcast(self, obj):
        return obj

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def gather(self, obj) -> list:
        return [obj]


def check_weights(canonical: Dict[str, torch.Tensor], cfg: Config, where: str) -> Dict[str, torch.Tensor]:
    """Pad a foreign vocabulary like Megatron does, then require exactly the model's names and shapes."""
    from mega_depth.model.decoder import CausalLM

    dc = cfg.decoder_config(padded_vocab_size(cfg.model.vocab_size))
    canonical = dict(canonical)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = canonical.get(name)
        if t is None or t.dim() != 2 or t.shape[0] >= dc.vocab_size:
            continue
        # only the padding rows are made up: a table shorter than its own vocabulary lost real tokens' rows
        if t.shape[0] < cfg.model.vocab_size:
            raise ConfigError(f"{where}: {name} has {t.shape[0]} rows but its config's vocab_size is "
                              f"{cfg.model.vocab_size}; the weights are truncated or belong to another config "
                              f"(transformers refuses them too): convert the matching weights")
        canonical[name] = torch.cat([t, t.new_zeros(dc.vocab_size - t.shape[0], t.shape[1])])
    with torch.device("meta"):
        expected = CausalLM(dc).state_dict()
    if dc.tie_word_embeddings:
        expected.pop("lm_head.weight")
        canonical.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(canonical))
    unexpected = sorted(set(canonical) - set(expected))
    wrong = [f"{k} {tuple(canonical[k].shape)} != {tuple(expected[k].shape)}" for k in sorted(expected)
             if k in canonical and tuple(canonical[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or wrong:
        raise ConfigError(f"{where}: its weights do not match its config (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}, shapes {wrong[:2]})")
    return canonical


def write_model_only(canonical: Dict[str, torch.Tensor], cfg: Config, save: str, source: str,
                     tokenizer: Optional[str] = None, force: bool = False) -> str:
    """A weights-only checkpoint of `canonical` for the model of `cfg` in --save `save` (iter_0000000)."""
    from safetensors.torch import save_file

    if os.path.isdir(save) and rules.folder_contents(save) and not force:
        raise ConfigError(f"--save {save} exists and is not empty; pass --force to write into it")
    canonical = check_weights(canonical, cfg, source)
    if tokenizer:  # keep the tokenizer with the weights, and record it for a later export
        os.makedirs(save, exist_ok=True)
        shutil.copy(tokenizer, os.path.join(save, "tokenizer.model"))
        cfg.data.tokenizer_model = os.path.abspath(os.path.join(save, "tokenizer.model"))
    weights = {k: v.detach().float().contiguous() for k, v in canonical.items()}
    meta = rules.run_meta(cfg, "plain", rules.new_run_id(), model_only=True, imported_from=source, layout={})
    return rules.save(save, 0, lambda tmp: save_file(weights, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"}),
                      meta, keep_last=1, comm=SingleProcess(), replace_other=force)[0]  # (--force: the user's word)
