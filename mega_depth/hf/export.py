"""mega_depth checkpoint <-> Hugging Face folder.

Export: load the distributed checkpoint of any TP/PP/DP layout in ONE process (dist_checkpointing reshards to
TP=1, PP=1), map Megatron names to the canonical ones and write
- standard residual: a native Qwen3 (q/k-norm) or Llama folder, no remote code;
- AttnRes / DCA / Depth-Attention: the `mega_depth_lm` architecture, loaded with trust_remote_code; its code is
  mega_depth's own model.py + mixing.py copied next to a thin modeling file.
Always: config.json, generation_config.json, safetensors (sharded with an index past --max-shard-size),
tokenizer.model + tokenizer_config.json. Everything is written to a temporary folder and renamed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Dict, Tuple

import torch

from mega_depth.config import Config, ConfigError, ModelConfig, ResidualConfig
from mega_depth.model import DecoderConfig

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(_HERE)
CODE_FILES = {  # exported name -> source in the package
    "configuration_mega_depth.py": os.path.join(_HERE, "configuration_mega_depth.py"),
    "modeling_mega_depth.py": os.path.join(_HERE, "modeling_mega_depth.py"),
    "model.py": os.path.join(_PACKAGE, "model.py"),
    "mixing.py": os.path.join(_PACKAGE, "mixing.py"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _megatron_world() -> None:
    from megatron.core import parallel_state

    from mega_depth.training.setup import init_distributed

    init_distributed()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def _config_from_meta(meta: dict) -> Config:
    saved = meta["config"]
    cfg = Config(model=ModelConfig(**saved["model"]), residual=ResidualConfig(**saved["residual"]))
    cfg.data.mock_data = True  # only the model matters here
    return cfg


def load_megatron_weights(ckpt: str) -> Tuple[Dict[str, torch.Tensor], dict, DecoderConfig]:
    """Full (TP=1, PP=1) Megatron state dict of a checkpoint saved in any layout, its metadata, and the model
    config. One process: dist_checkpointing reassembles the shards."""
    from megatron.core import dist_checkpointing, tensor_parallel

    from mega_depth.megatron.builder import build_model_chunks
    from mega_depth.init import padded_vocab_size
    from mega_depth.megatron.state_dict import decoder_config
    from mega_depth.checkpoint_dirs import read_meta, resolve

    ckpt = resolve(ckpt)
    meta = read_meta(ckpt)
    cfg = _config_from_meta(meta)
    _megatron_world()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    (model,) = build_model_chunks(cfg)
    template = {"model0": model.sharded_state_dict()}
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        loaded = dist_checkpointing.load(template, ckpt)
    except (Exception, CheckpointException) as e:  # a shape/key mismatch between mega_depth.json and the tensors
        lines = [l.strip() for l in str(e).splitlines() if "mismatch" in l or "Missing" in l] or [str(e)[-300:]]
        raise ConfigError(f"checkpoint {ckpt}: its weights do not match its recorded config ({lines[-1]}); the "
                          "checkpoint is damaged or mega_depth.json was edited") from None
    try:
        model.load_state_dict(loaded["model0"])
    except RuntimeError as e:
        raise ConfigError(f"checkpoint {ckpt}: its weights do not match its recorded config ({e})") from None
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return state, meta, decoder_config(meta["config"], padded_vocab_size(cfg.model.vocab_size))


def load_canonical_weights(load: str) -> Tuple[Dict[str, torch.Tensor], dict, DecoderConfig]:
    """Canonical (Hugging Face-named) weights, metadata and model config of any mega_depth checkpoint: a Megatron
    one in any layout, or a plain one from the XLA trainer (mega_depth/xla/checkpoint.py)."""
    from mega_depth.checkpoint_dirs import read_meta, resolve
    from mega_depth.init import padded_vocab_size
    from mega_depth.megatron.state_dict import decoder_config, to_canonical
    from mega_depth.xla import checkpoint as plain

    ckpt = resolve(load)
    if plain.is_plain(ckpt):
        meta = read_meta(ckpt)
        dc = decoder_config(meta["config"], padded_vocab_size(meta["config"]["model"]["vocab_size"]))
        return plain.load_weights(ckpt), meta, dc
    state, meta, dc = load_megatron_weights(ckpt)
    return to_canonical(state, dc), meta, dc


def _qwen3_or_llama(dc: DecoderConfig, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=dc.vocab_size, hidden_size=dc.hidden_size, intermediate_size=dc.ffn_hidden_size,
                  num_hidden_layers=dc.num_layers, num_attention_heads=dc.num_attention_heads,
                  num_key_value_heads=dc.num_query_groups, head_dim=dc.head_dim, hidden_act="silu",
                  max_position_embeddings=max_positions, rms_norm_eps=dc.norm_epsilon,
                  tie_word_embeddings=dc.tie_word_embeddings, attention_bias=False, bos_token_id=1, eos_token_id=2,
                  rope_parameters={"rope_type": "default", "rope_theta": dc.rotary_base})
    if dc.qk_layernorm:
        return Qwen3ForCausalLM(Qwen3Config(**common, use_sliding_window=False))
    return LlamaForCausalLM(LlamaConfig(**common, mlp_bias=False))


def _mega_depth_model(dc: DecoderConfig, max_positions: int):
    from mega_depth.hf.configuration_mega_depth import MegaDepthConfig
    from mega_depth.hf.modeling_mega_depth import MegaDepthForCausalLM

    config = MegaDepthConfig(
        vocab_size=dc.vocab_size, hidden_size=dc.hidden_size, num_hidden_layers=dc.num_layers,
        num_attention_heads=dc.num_attention_heads, num_key_value_heads=dc.num_query_groups,
        intermediate_size=dc.ffn_hidden_size, rms_norm_eps=dc.norm_epsilon, rope_theta=dc.rotary_base,
        qk_layernorm=dc.qk_layernorm, residual=dc.residual, attnres_num_blocks=dc.attnres_num_blocks,
        dca_last_k=dc.dca_last_k, dca_grn=dc.dca_grn, depth_attn_stride=dc.depth_attn_stride,
        depth_attn_window=dc.depth_attn_window, depth_attn_gqa=dc.depth_attn_gqa,
        tie_word_embeddings=dc.tie_word_embeddings, max_position_embeddings=max_positions, bos_token_id=1,
        eos_token_id=2,
    )
    config.auto_map = {"AutoConfig": "configuration_mega_depth.MegaDepthConfig",
                       "AutoModelForCausalLM": "modeling_mega_depth.MegaDepthForCausalLM"}
    config.architectures = ["MegaDepthForCausalLM"]
    return MegaDepthForCausalLM(config)


def write_tokenizer(spm_model: str, out: str) -> None:
    """tokenizer.model + a tokenizer_config.json naming the special tokens (AutoTokenizer reproduces the
    sentencepiece ids; mega_depth trains without BOS, so none is added)."""
    shutil.copy(spm_model, os.path.join(out, "tokenizer.model"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "add_bos_token": False,
                   "add_eos_token": False, "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False},
                  f, indent=1)


def export(load: str, out: str, dtype: str = "fp32", force: bool = False, tokenizer_model: str = None,
           max_shard_size: str = "2GB") -> str:
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not force:
        raise ConfigError(f"--out {out} exists and is not empty; pass --force to replace it")
    canonical, meta, dc = load_canonical_weights(load)
    spm = tokenizer_model or meta["config"].get("data", {}).get("tokenizer_model")
    if not spm or not os.path.isfile(spm):
        raise ConfigError(f"no tokenizer for this checkpoint ({spm or 'none recorded'}); pass --tokenizer-model "
                          "(the sentencepiece model the data was made with)")
    max_positions = meta["config"]["model"]["seq_length"]
    model = (_qwen3_or_llama if dc.residual == "standard" else _mega_depth_model)(dc, max_positions)
    missing, unexpected = model.load_state_dict(canonical, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and dc.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(f"checkpoint does not map onto the exported architecture: missing {missing}, "
                          f"unexpected {unexpected}")
    model = model.to(DTYPES[dtype])
    from transformers import GenerationConfig

    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=False, max_new_tokens=64).save_pretrained(tmp)
        if dc.residual != "standard":
            for name, src in CODE_FILES.items():
                shutil.copy(src, os.path.join(tmp, name))
        write_tokenizer(spm, tmp)
        with open(os.path.join(tmp, "mega_depth.json"), "w") as f:
            json.dump({"exported_from": os.path.abspath(load), "step": meta["step"], "config": meta["config"]}, f,
                      indent=1)
        if os.path.exists(out):
            shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _read_hf_weights(folder: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"{folder} has no model.safetensors (or index); export with safetensors")
    out = {}
    for name in files:
        out.update(load_file(os.path.join(folder, name)))
    return out


def _plain_checkpoint(path: str):
    """The iter_N directory if `path` is (a --save root of) an XLA-trainer checkpoint, else None."""
    from mega_depth.checkpoint_dirs import resolve
    from mega_depth.xla import checkpoint as plain

    try:
        ckpt = resolve(path)
    except ConfigError:
        return None
    return ckpt if plain.is_plain(ckpt) else None


def import_hf(folder: str, save: str, force: bool = False) -> str:
    """A Hugging Face folder (a mega_depth export, or a native Qwen3/Llama model) or an XLA-trainer checkpoint ->
    a weights-only Megatron checkpoint that `python -m mega_depth.train --load` fine-tunes from (any layout)."""
    from mega_depth.megatron.builder import build_model_chunks
    from mega_depth.init import padded_vocab_size
    from mega_depth.megatron.state_dict import from_canonical
    from mega_depth.training.checkpoint import save_model_only

    from mega_depth.xla import checkpoint as plain

    if os.path.isdir(save) and os.listdir(save) and not force:
        raise ConfigError(f"--save {save} exists and is not empty; pass --force to write into it")
    plain_dir = _plain_checkpoint(folder)
    config_path = os.path.join(folder, "config.json")
    if plain_dir is None and not os.path.isfile(config_path):
        raise ConfigError(f"{folder} is neither a Hugging Face model folder (no config.json) nor an XLA-trainer "
                          "checkpoint")
    hf = json.load(open(config_path)) if plain_dir is None else {}
    meta_path = os.path.join(folder, "mega_depth.json")
    if plain_dir is not None:  # the XLA trainer's checkpoint: canonical weights and the exact config
        meta = json.load(open(os.path.join(plain_dir, "mega_depth.json")))
        cfg = _config_from_meta(meta)
        cfg.data.tokenizer_model = meta["config"].get("data", {}).get("tokenizer_model")
    elif os.path.isfile(meta_path):  # our own export: the exact training config travels with it
        cfg = _config_from_meta(json.load(open(meta_path)))
    elif hf.get("model_type") in ("qwen3", "llama"):
        rope = hf.get("rope_parameters") or {}
        cfg = Config()
        m = cfg.model
        m.num_layers, m.hidden_size = hf["num_hidden_layers"], hf["hidden_size"]
        m.num_attention_heads, m.num_query_groups = hf["num_attention_heads"], hf.get("num_key_value_heads")
        m.ffn_hidden_size, m.vocab_size = hf["intermediate_size"], hf["vocab_size"]
        m.norm_epsilon, m.qk_layernorm = hf.get("rms_norm_eps", 1e-6), hf["model_type"] == "qwen3"
        m.rotary_base = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        m.untie_embeddings_and_output_weights = not hf.get("tie_word_embeddings", False)
        m.seq_length = min(hf.get("max_position_embeddings", 4096), 4096)
        if hf.get("head_dim", m.hidden_size // m.num_attention_heads) != m.hidden_size // m.num_attention_heads:
            raise ConfigError(f"{folder}: head_dim != hidden_size / num_attention_heads is not supported")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ConfigError(f"{folder}: attention or MLP biases are not supported (Llama/Qwen3 without bias)")
        cfg.data.mock_data = True
    else:
        raise ConfigError(f"{folder} holds a {hf.get('model_type')!r} model; import supports mega_depth exports "
                          "and native qwen3/llama folders")
    from mega_depth.megatron.state_dict import decoder_config
    from mega_depth.config import to_dict

    padded = padded_vocab_size(cfg.model.vocab_size)
    dc = decoder_config(to_dict(cfg), padded)
    canonical = plain.load_weights(plain_dir) if plain_dir is not None else _read_hf_weights(folder)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # foreign vocabularies: pad rows like Megatron
        if name in canonical and canonical[name].shape[0] < padded:
            t = canonical[name]
            canonical[name] = torch.cat([t, t.new_zeros(padded - t.shape[0], t.shape[1])])
    megatron = from_canonical(canonical, dc)
    _megatron_world()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg.validate(1)
    (model,) = build_model_chunks(cfg)
    dtype = next(model.parameters()).dtype
    try:
        model.load_state_dict({k: v.to(dtype) for k, v in megatron.items()}, strict=False)
    except RuntimeError as e:
        raise ConfigError(f"{folder}: its weights do not match its config.json ({e})") from None
    missing = [k for k in model.state_dict() if k not in megatron and not k.endswith("_extra_state")
               and not (k == "output_layer.weight" and dc.tie_word_embeddings)]
    if missing:
        raise ConfigError(f"{folder}: weights missing for {missing[:5]}")
    tokenizer = os.path.join(folder, "tokenizer.model")
    if os.path.isfile(tokenizer):  # keep the tokenizer with the weights, and record it for a later export
        os.makedirs(save, exist_ok=True)
        shutil.copy(tokenizer, os.path.join(save, "tokenizer.model"))
        cfg.data.tokenizer_model = os.path.abspath(os.path.join(save, "tokenizer.model"))
    return save_model_only([model], cfg, save)
