"""The weights of any mega_depth checkpoint in canonical (Hugging Face) names, in one process, pure torch.

Formats (mega_depth.json "format"):
- megatron: megatron-core's torch_dist dist-checkpoint. Its shards are read by key with
  torch.distributed.checkpoint (no Megatron model, no process group): layers stack along a leading dim
  ("decoder.layers.x", homogeneous layers) or are keyed per layer ("decoder.layers.<i>.x"); a layer's routed
  experts stack along their own leading dim ("...mlp.experts.experts.linear_fc1.weight" [E, ...]).
- deepspeed, plain: the checkpoint carries model.safetensors in canonical names.
The state-dict adapter (mega_depth/model/state_dict_adapter.py) maps Megatron names to canonical ones.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Dict, Tuple

import torch

from mega_depth.checkpoint.manifest import CorruptCheckpoint
from mega_depth.config import Config, ModelConfig
from mega_depth.init import padded_vocab_size
from mega_depth.model.config import DecoderConfig, residual_config
from mega_depth.model.state_dict_adapter import LOCAL_EXPERT, STACKED_EXPERTS

WEIGHTS = "model.safetensors"
# The local layer spec's sharded_state_dict_keys_map (megatron/core/models/gpt/gpt_layer_specs.py, 0.16.1): layer
# norms are checkpointed under the fused Transformer Engine names, so that the two specs share checkpoints.
_SHARDED_KEY_RENAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _sharded_key(name: str) -> str:
    for old, new in _SHARDED_KEY_RENAMES.items():
        if f".{old}" in name:
            return name.replace(f".{old}", f".{new}")
    return name


class UnreadableShards(CorruptCheckpoint):
    """A shard file that torch.distributed.checkpoint cannot read (truncated, missing): the files are damaged, as
    opposed to weights that disagree with the recorded config."""


def saved_config(meta: dict) -> Config:
    """The model and mechanism a checkpoint recorded, as a Config (older checkpoints: missing options default)."""
    saved = meta["config"]
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in saved["model"].items() if k in model_fields})
    known = {f.name for f in dataclasses.fields(type(Config().residual))} | {"residual"}  # (the old name)
    residual = {k: v for k, v in saved["residual"].items() if k in known}
    cfg = Config(model=model, residual=residual_config(residual, saved=True))
    cfg.data.mock_data = True  # only the model matters here
    return cfg


def decoder_config(meta: dict) -> DecoderConfig:
    """The plain decoder's config of a checkpoint (vocabulary padded as the embedding is)."""
    cfg = saved_config(meta)
    return cfg.decoder_config(padded_vocab_size(cfg.model.vocab_size))


def megatron_full_state(ckpt_dir: str, dc: DecoderConfig) -> Dict[str, torch.Tensor]:
    """The full (TP=1, PP=1) Megatron state dict of a torch_dist checkpoint saved in any layout."""
    import torch.distributed.checkpoint as dcp

    from mega_depth.model.decoder import CausalLM
    from mega_depth.model.state_dict_adapter import from_canonical

    reader = dcp.FileSystemReader(ckpt_dir)
    try:
        stored = reader.read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - any failure to read the index means the files are damaged
        raise CorruptCheckpoint(f"its dist-checkpoint index (.metadata) is unreadable ({type(e).__name__})") from None
    with torch.device("meta"):
        template = CausalLM(dc).state_dict()
    if dc.tie_word_embeddings:
        template.pop("lm_head.weight", None)
    expected = from_canonical(template, dc)  # Megatron name -> meta tensor of the full shape
    request, where = {}, {}
    for name, t in expected.items():
        # a routed expert's weight is stored stacked over the layer's experts: experts.experts.<x> [E, ...]
        expert = LOCAL_EXPERT.search(name)
        sharded = _sharded_key(name) if expert is None else _sharded_key(name).replace(expert.group(0), STACKED_EXPERTS)
        parts = sharded.split(".")
        stacked = ".".join(parts[:2] + parts[3:]) if name.startswith("decoder.layers.") else None
        inner = () if expert is None else (int(expert.group(1)),)
        if ".".join(parts) in stored:
            key, index = ".".join(parts), inner
        elif stacked is not None and stacked in stored:
            key, index = stacked, (int(parts[2]),) + inner
        else:
            raise CorruptCheckpoint(f"its shards hold no tensor for {name}")
        if key not in request:
            meta = stored[key]
            request[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        where[name] = (key, index)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # one process on purpose: torch's "assuming the intent" warning is noise
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(request, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (CheckpointException is a BaseException)
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
        raise UnreadableShards(f"its shards cannot be read ({type(cause).__name__}: {str(cause)[:120]})") from None
    out = {}
    for name, (key, index) in where.items():
        value = request[key][index] if index else request[key]
        if tuple(value.shape) != tuple(expected[name].shape):
            raise CorruptCheckpoint(f"{name} has shape {tuple(value.shape)}, its recorded config needs "
                                    f"{tuple(expected[name].shape)}")
        out[name] = value.clone()
    return out


def canonical_weights(ckpt_dir: str, meta: dict) -> Tuple[Dict[str, torch.Tensor], DecoderConfig]:
    """(canonical weights, decoder config) of one checkpoint directory."""
    from mega_depth.model.state_dict_adapter import to_canonical

    dc = decoder_config(meta)
    if meta.get("format", "megatron") == "megatron":
        return to_canonical(megatron_full_state(ckpt_dir, dc), dc), dc
    from safetensors.torch import load_file

    path = os.path.join(ckpt_dir, WEIGHTS)
    if not os.path.isfile(path):
        raise CorruptCheckpoint(f"{WEIGHTS} is missing")
    return load_file(path), dc


def full_megatron_weights(ckpt_dir: str, meta: dict) -> Dict[str, torch.Tensor]:
    """The full Megatron state dict of any checkpoint (weights-only loads into any layout start from this)."""
    from mega_depth.model.state_dict_adapter import from_canonical

    if meta.get("format", "megatron") == "megatron":
        return megatron_full_state(ckpt_dir, decoder_config(meta))
    canonical, dc = canonical_weights(ckpt_dir, meta)
    return from_canonical(canonical, dc)
