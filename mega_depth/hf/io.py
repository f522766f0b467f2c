"""Hugging Face folders in and out: file IO only (the weights are canonical already; see checkpoint/weights.py).

Writing: the standard residual becomes a native Qwen3 (q/k-norm) or Llama folder, with no remote code, and with
experts a native Qwen3-MoE folder where its layer is this one (softmax top-k renormalised, no shared expert, no
expert bias); every depth-mixing mechanism (and any other MoE) the `mega_depth_lm` architecture (trust_remote_code=True), whose folder carries
configuration_mega_depth.py, modeling_mega_depth.py and mega_depth/model/*.py (the decoder, the mechanisms, the
math) flat beside them. Always: config.json, generation_config.json, safetensors (sharded with an index past
max_shard_size), tokenizer.model + tokenizer_config.json and mega_depth.json (the exact training config). Written to
a temporary folder and renamed at the end. Every export names a pad token (special_tokens: EOS `</s>` unless the
sentencepiece model has a pad piece) in config.json, generation_config.json and tokenizer_config.json, so padded
batches (generate, pipeline(batch_size=...)) work as with any Hugging Face causal LM.

Reading: a mega_depth export (its mega_depth.json has the exact config) or a native Qwen3 / Qwen3-MoE / Llama
folder.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from typing import Dict, Optional, Tuple

import torch

from mega_depth.checkpoint.manifest import file_sha256
from mega_depth.config import Config, ConfigError
from mega_depth.model.config import DecoderConfig, flag_values

_HERE = os.path.dirname(os.path.abspath(__file__))
_MODEL_DIR = os.path.join(os.path.dirname(_HERE), "model")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def code_files() -> Dict[str, str]:
    """Exported file name -> source: the two Hugging Face files and the flat mega_depth/model folder."""
    files = {name: os.path.join(_HERE, name) for name in ("configuration_mega_depth.py", "modeling_mega_depth.py")}
    for path in sorted(glob.glob(os.path.join(_MODEL_DIR, "*.py"))):
        if os.path.basename(path) != "__init__.py":
            files[os.path.basename(path)] = path
    return files


def special_tokens(spm_model: str) -> Dict[str, Optional[Tuple[str, int]]]:
    """{"bos"|"eos"|"unk"|"pad": (piece, id)} of the export, read from the sentencepiece model (mega_depth's own
    tokenizers are Llama's layout, <s> = 1 and </s> = 2, but a model trained elsewhere may number them otherwise;
    the training data ends each document with its EOS id). bos is None for a model without one. The pad is the
    model's own pad piece where it has one; otherwise EOS, as Llama-family models commonly do: pads are masked
    out, so which token fills them does not matter, and a real piece keeps the vocabulary unchanged."""
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=spm_model)
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"{spm_model} is not a sentencepiece model ({str(e)[:80]}); pass --tokenizer-model (the "
                          "sentencepiece model the data was made with)") from None

    def piece(i: int) -> Optional[Tuple[str, int]]:
        return (sp.id_to_piece(i), i) if 0 <= i < sp.get_piece_size() else None

    eos = piece(sp.eos_id())
    if eos is None:
        raise ConfigError(f"{spm_model} has no end-of-sequence piece (eos_id {sp.eos_id()}), which ends each "
                          "document in the training data and stops generation; pass the tokenizer the data was made "
                          "with (tools/train_tokenizer.py makes </s> = 2)")
    return {"bos": piece(sp.bos_id()), "eos": eos, "unk": piece(sp.unk_id()), "pad": piece(sp.pad_id()) or eos}


def token_ids(tokens: Dict[str, Optional[Tuple[str, int]]]) -> Dict[str, Optional[int]]:
    """The bos / eos / pad ids of special_tokens, as a config's bos_token_id / eos_token_id / pad_token_id."""
    return {f"{name}_token_id": None if tokens[name] is None else tokens[name][1] for name in ("bos", "eos", "pad")}


def _piece_count(spm_model: str) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=spm_model).get_piece_size()


def native_architecture(dc: DecoderConfig) -> Optional[str]:
    """The transformers model type that computes this model exactly (None: the mega_depth_lm architecture)."""
    if dc.mechanism().mixes_depth:
        return None
    if not dc.num_experts:
        return "qwen3" if dc.qk_layernorm else "llama"
    # Qwen3-MoE: softmax over all experts, top-k, renormalised (norm_topk_prob); no shared expert, no bias
    plain_topk = dc.moe_router_score_function == "softmax" and not dc.moe_router_pre_softmax
    if dc.qk_layernorm and plain_topk and not dc.moe_shared_expert_intermediate_size \
            and not dc.moe_router_enable_expert_bias:
        return "qwen3_moe"
    return None


def _stacked_experts(canonical: Dict[str, torch.Tensor], dc: DecoderConfig) -> Dict[str, torch.Tensor]:
    """Per-expert canonical weights (Qwen3-MoE's files) -> transformers' in-memory Qwen3-MoE: each layer's experts
    stacked, gate and up fused ([E, 2F, d] and [E, d, F])."""
    out = {k: v for k, v in canonical.items() if ".mlp.experts." not in k}
    for i in range(dc.num_layers):
        if not dc.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([torch.cat([canonical[f"{p}{e}.gate_proj.weight"],
                                                          canonical[f"{p}{e}.up_proj.weight"]])
                                               for e in range(dc.num_experts)])
        out[p + "down_proj"] = torch.stack([canonical[f"{p}{e}.down_proj.weight"] for e in range(dc.num_experts)])
    return out


def _native_model(dc: DecoderConfig, max_positions: int, ids: Dict[str, Optional[int]]):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    common = dict(vocab_size=dc.vocab_size, hidden_size=dc.hidden_size, intermediate_size=dc.ffn_hidden_size,
                  num_hidden_layers=dc.num_layers, num_attention_heads=dc.num_attention_heads,
                  num_key_value_heads=dc.num_query_groups, head_dim=dc.head_dim, hidden_act="silu",
                  max_position_embeddings=max_positions, rms_norm_eps=dc.norm_epsilon,
                  tie_word_embeddings=dc.tie_word_embeddings, attention_bias=False, **ids,
                  rope_parameters={"rope_type": "default", "rope_theta": dc.rotary_base})
    kind = native_architecture(dc)
    if kind == "qwen3_moe":
        dense = [i for i in range(dc.num_layers) if not dc.is_moe_layer(i)]
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, use_sliding_window=False, num_experts=dc.num_experts, num_experts_per_tok=dc.moe_router_topk,
            moe_intermediate_size=dc.moe_ffn_hidden_size, decoder_sparse_step=1, mlp_only_layers=dense,
            norm_topk_prob=True, output_router_logits=False))
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, use_sliding_window=False))
    return LlamaForCausalLM(LlamaConfig(**common, mlp_bias=False))


def _mega_depth_model(dc: DecoderConfig, max_positions: int, ids: Dict[str, Optional[int]]):
    from mega_depth.hf.configuration_mega_depth import MegaDepthConfig
    from mega_depth.hf.modeling_mega_depth import MegaDepthForCausalLM

    config = MegaDepthConfig(
        vocab_size=dc.vocab_size, hidden_size=dc.hidden_size, num_hidden_layers=dc.num_layers,
        num_attention_heads=dc.num_attention_heads, num_key_value_heads=dc.num_query_groups,
        intermediate_size=dc.ffn_hidden_size, rms_norm_eps=dc.norm_epsilon, rope_theta=dc.rotary_base,
        qk_layernorm=dc.qk_layernorm, residual=dc.residual_values(),
        depth_mixing_inference=dc.mechanism().inference_form(), tie_word_embeddings=dc.tie_word_embeddings,
        moe=dc.moe_values(),
        max_position_embeddings=max_positions, **ids)
    config.auto_map = {"AutoConfig": "configuration_mega_depth.MegaDepthConfig",
                       "AutoModelForCausalLM": "modeling_mega_depth.MegaDepthForCausalLM"}
    config.architectures = ["MegaDepthForCausalLM"]
    return MegaDepthForCausalLM(config)


def write_tokenizer(spm_model: str, out: str) -> None:
    """tokenizer.model + a tokenizer_config.json naming the tokenizer class and the special tokens, the pad token
    included (AutoTokenizer reproduces the sentencepiece ids; mega_depth trains without BOS, so none is added).
    Padding goes on the left, where a decoder-only model's batched generation needs it."""
    tokens = special_tokens(spm_model)
    shutil.copy(spm_model, os.path.join(out, "tokenizer.model"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        named = {f"{name}_token": tokens[name][0] for name in ("bos", "eos", "unk", "pad") if tokens[name]}
        json.dump({"tokenizer_class": "LlamaTokenizer", **named, "padding_side": "left",
                   "add_bos_token": False, "add_eos_token": False, "model_max_length": 1 << 20,
                   "clean_up_tokenization_spaces": False, "legacy": False}, f, indent=1)


def write_folder(canonical: Dict[str, torch.Tensor], dc: DecoderConfig, out: str, tokenizer_model: str,
                 max_positions: int, provenance: dict, dtype: str = "fp32", force: bool = False,
                 max_shard_size: str = "2GB") -> str:
    """Write a Hugging Face folder for canonical weights; nothing is left half-written on failure."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not force:
        raise ConfigError(f"--out {out} exists and is not empty; pass --force to replace it")
    if not tokenizer_model or not os.path.isfile(tokenizer_model):
        raise ConfigError(f"no tokenizer for this checkpoint ({tokenizer_model or 'none recorded'}); pass "
                          "--tokenizer-model (the sentencepiece model the data was made with)")
    ids = token_ids(special_tokens(tokenizer_model))
    pieces = _piece_count(tokenizer_model)
    if pieces > dc.vocab_size:  # generation would index past the embedding
        raise ConfigError(f"--tokenizer-model {tokenizer_model} has {pieces} pieces, more than the model's "
                          f"vocabulary ({dc.vocab_size}); pass the tokenizer the model was trained with")
    native = native_architecture(dc) is not None
    model = (_native_model if native else _mega_depth_model)(dc, max_positions, ids)
    if native_architecture(dc) == "qwen3_moe":  # its files hold the canonical per-expert names again
        canonical = _stacked_experts(canonical, dc)
    missing, unexpected = model.load_state_dict(canonical, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and dc.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(f"the weights do not map onto the exported architecture: missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}")
    kept = {name: t for name, t in model.state_dict().items()  # (the class's fp32 tensors: expert biases)
            if any(key in name for key in getattr(model, "_keep_in_fp32_modules_strict", None) or [])}
    model = model.to(DTYPES[dtype])
    for name, value in kept.items():
        module, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module), leaf, value.float())
    from transformers import GenerationConfig

    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        GenerationConfig(**ids, do_sample=False, max_new_tokens=64).save_pretrained(tmp)
        if not native:
            for name, src in code_files().items():
                shutil.copy(src, os.path.join(tmp, name))
        write_tokenizer(tokenizer_model, tmp)
        with open(os.path.join(tmp, "mega_depth.json"), "w") as f:
            json.dump(provenance, f, indent=1)
        if os.path.exists(out):
            shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_weights(folder: str) -> Dict[str, torch.Tensor]:
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
        path = os.path.join(folder, name)
        try:
            out.update(load_file(path))
        except Exception as e:  # safetensors raises its own error type for a truncated or foreign file
            raise ConfigError(f"{path} cannot be read as safetensors ({type(e).__name__}: {str(e)[:80]}): it is "
                              "truncated or not a weights file; copy or export it again") from None
    return out


def check_disjoint(source: str, dest: str, source_flag: str, dest_flag: str) -> None:
    """Writing `dest` must not touch `source`: refuse the same folder, one inside the other, either way."""
    src, dst = os.path.realpath(source), os.path.realpath(dest)
    if src == dst or dst.startswith(src + os.sep) or src.startswith(dst + os.sep):
        where = "is" if src == dst else "lies inside" if dst.startswith(src + os.sep) else "contains"
        raise ConfigError(f"{dest_flag} {dest} {where} {source_flag} {source}: writing it would delete what it is "
                          f"made from; choose a {dest_flag} outside {source}")


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); {what}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must hold a JSON object; {what}")
    return value


_AGREEING = (("num_hidden_layers", "num_layers"), ("hidden_size", "hidden_size"),
             ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_query_groups"),
             ("intermediate_size", "ffn_hidden_size"), ("tie_word_embeddings", "tie_word_embeddings"),
             ("vocab_size", "vocab_size"), ("head_dim", "head_dim"), ("rms_norm_eps", "norm_epsilon"),
             ("qk_layernorm", "qk_layernorm"), ("rope_theta", "rotary_base"))


def check_agreement(hf: dict, cfg: Config, folder: str) -> None:
    """config.json and mega_depth.json of one folder describe the same model (one of them was edited otherwise,
    and the weights follow only one)."""
    from mega_depth.init import padded_vocab_size

    dc = cfg.decoder_config(padded_vocab_size(cfg.model.vocab_size) if cfg.model.vocab_size else None)
    hf = dict(hf)
    if isinstance(hf.get("rope_parameters"), dict) and "rope_theta" in hf["rope_parameters"]:  # (transformers 5)
        hf.setdefault("rope_theta", hf["rope_parameters"]["rope_theta"])
    diffs = [f"{hf_key} {hf[hf_key]!r} vs {key} {getattr(dc, key)!r}" for hf_key, key in _AGREEING
             if hf_key in hf and hf[hf_key] != getattr(dc, key)]
    if "residual" in hf and hf["residual"] != dc.residual_values():
        diffs.append(f"residual {hf['residual']!r} vs {dc.residual_values()!r}")
    if "moe" in hf and hf["moe"] != dc.moe_values():
        diffs.append(f"moe {hf['moe']!r} vs {dc.moe_values()!r}")
    if diffs:
        raise ConfigError(f"{folder}: config.json and mega_depth.json disagree ({'; '.join(diffs[:3])}): the folder "
                          "was edited; restore the file that was changed (or export it again)")


def _native_config(hf: dict, folder: str) -> Config:
    """The training config of a native Qwen3 / Llama folder (standard residual)."""
    rope = hf.get("rope_parameters") or {}
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    if hf.get("head_dim", hf["hidden_size"] // heads) != hf["hidden_size"] // heads:
        raise ConfigError(f"{folder}: head_dim != hidden_size / num_attention_heads is not supported")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(f"{folder}: attention or MLP biases are not supported (Llama/Qwen3 without bias)")
    # what the import cannot represent is refused, never dropped: the model would load as another one
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type")) or scaling.get("rope_type", scaling.get("type")) or "default"
    if rope_type != "default":
        raise ConfigError(f"{folder}: RoPE scaling {rope_type!r} (rope_parameters / rope_scaling) is not supported; "
                          "only plain RoPE (rope_type 'default') imports")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"{folder}: hidden_act {hf['hidden_act']!r} is not supported; only SwiGLU (silu) imports")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{folder}: sliding-window attention (use_sliding_window) is not supported; only full "
                          "causal attention imports")
    moe = {}
    if hf["model_type"] == "qwen3_moe":
        if not hf.get("norm_topk_prob", False):
            raise ConfigError(f"{folder}: Qwen3-MoE with norm_topk_prob false (top-k weights not renormalised) is "
                              "not a routing mega_depth trains; only norm_topk_prob true imports")
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        moe = dict(num_experts=hf.get("num_experts", hf.get("num_local_experts")),  # (transformers 5: the latter)
                   moe_router_topk=hf["num_experts_per_tok"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
                   moe_layer_pattern=[int(i not in dense and (i + 1) % step == 0) for i in range(layers)])
    record = DecoderConfig(
        num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        qk_layernorm=hf["model_type"] in ("qwen3", "qwen3_moe"),
        rotary_base=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        tie_word_embeddings=hf.get("tie_word_embeddings", False), **moe)
    cfg = Config()
    for name, value in flag_values(record).items():
        setattr(cfg.model, name, value)
    cfg.model.seq_length = min(hf.get("max_position_embeddings", 4096), 4096)
    return cfg


def read_folder(folder: str) -> Tuple[Dict[str, torch.Tensor], Config, Optional[str]]:
    """(canonical weights, training config, tokenizer model path or None) of a Hugging Face folder."""
    from mega_depth.checkpoint.weights import saved_config

    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"{folder} is not a Hugging Face model folder (no config.json) nor a mega_depth "
                          "checkpoint; pass an exported folder, a Qwen3/Llama folder or a --save directory")
    hf = _read_json(config_path, "the folder is damaged")
    meta_path = os.path.join(folder, "mega_depth.json")
    if os.path.isfile(meta_path):  # our own export: the exact training config travels with it
        meta = _read_json(meta_path, "the export is damaged; export it again")
        try:
            cfg = saved_config(meta)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{meta_path} does not hold a mega_depth training config ({type(e).__name__}: "
                              f"{str(e)[:60]}); the export is damaged: export it again") from None
        check_agreement(hf, cfg, folder)
    elif hf.get("model_type") in ("qwen3", "llama", "qwen3_moe"):
        cfg = _native_config(hf, folder)
    elif hf.get("model_type") == "mega_depth_lm":  # (re-saved by save_pretrained, which writes only its own files)
        raise ConfigError(f"{folder} holds a mega_depth model but not its mega_depth.json (the training config, "
                          "which save_pretrained does not write); copy mega_depth.json from the export it came from "
                          "into the folder, and import again")
    else:
        raise ConfigError(f"{folder} holds a {hf.get('model_type')!r} model; import supports mega_depth exports "
                          "and native qwen3/qwen3_moe/llama folders")
    tokenizer = os.path.join(folder, "tokenizer.model")
    return read_weights(folder), cfg, tokenizer if os.path.isfile(tokenizer) else None


# --------------------------------------------------------------------------------------------------------------
# The two conversions (tools/convert_to_hf.py, tools/convert_from_hf.py)
# --------------------------------------------------------------------------------------------------------------


def export_checkpoint(load: str, out: str, dtype: str = "fp32", force: bool = False,
                      tokenizer_model: Optional[str] = None, max_shard_size: str = "2GB", say=print) -> str:
    """Any mega_depth checkpoint (verified; a save folder falls back to its newest intact checkpoint) -> a Hugging
    Face folder."""
    from mega_depth.checkpoint.rules import find_checkpoint

    if dtype not in DTYPES:  # before any work
        raise ConfigError(f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if not os.path.exists(load):
        raise ConfigError(f"--load {load} does not exist")
    check_disjoint(load, out, "--load", "--out")  # --force or not: an export never replaces its source
    found = find_checkpoint(load, say=say)
    if found is None:
        raise ConfigError(f"--load {load} holds no checkpoint")
    ckpt, meta = found
    canonical, dc = _weights_of(ckpt, meta)
    config = meta["config"]
    tokenizer = tokenizer_model or config.get("data", {}).get("tokenizer_model")
    trained_with = meta.get("tokenizer_sha256")  # (checkpoints since 2026-12-04; --tokenizer-model: the user's)
    if tokenizer_model is None and trained_with and tokenizer and os.path.isfile(tokenizer) and \
            file_sha256(tokenizer) != trained_with:
        raise ConfigError(f"the tokenizer at the recorded path {tokenizer} is not the one this checkpoint was "
                          "trained with (its sha256 differs from the one the checkpoint recorded): it was replaced "
                          "since. Pass --tokenizer-model with the sentencepiece model the data was made with")
    return write_folder(canonical, dc, out, tokenizer,
                        config["model"]["seq_length"], {"exported_from": os.path.abspath(ckpt),
                                                        "step": meta["step"], "config": config},
                        dtype, force, max_shard_size)


def import_folder(source: str, save: str, force: bool = False, say=print) -> str:
    """A Hugging Face folder, or any mega_depth checkpoint (another trainer's, say), -> a weights-only checkpoint
    that every trainer's --load fine-tunes from in any layout."""
    from mega_depth.checkpoint import rules
    from mega_depth.checkpoint.plain import write_model_only
    from mega_depth.checkpoint.weights import saved_config

    if not os.path.isdir(source):
        raise ConfigError(f"--hf {source} does not exist")
    check_disjoint(source, save, "--hf", "--save")
    others = rules.list_checkpoints(save)
    if others:  # a training run's folder: an import beside its checkpoints would confuse its resume
        raise ConfigError(f"--save {save} holds training checkpoints ({os.path.basename(others[-1][1])}, ...): an "
                          "import must not write beside them, --force or not; import into a new folder and --load "
                          "that")
    tokenizer = None
    hf_folder = os.path.isfile(os.path.join(source, "config.json"))  # an export also carries a mega_depth.json
    if not hf_folder and (os.path.isfile(os.path.join(source, rules.META)) or rules.list_checkpoints(source)):
        found = rules.find_checkpoint(source, say=say)
        if found is None:
            raise ConfigError(f"--hf {source} holds no checkpoint")
        ckpt, meta = found
        canonical, _ = _weights_of(ckpt, meta)
        cfg = saved_config(meta)
        cfg.data.tokenizer_model = meta["config"].get("data", {}).get("tokenizer_model")
    else:
        canonical, cfg, tokenizer = read_folder(source)
    from mega_depth.checkpoint.lock import SaveFolderLocked, SaveLock

    try:
        with SaveLock(save, "import", "convert_from_hf", say):
            return write_model_only(canonical, cfg, save, os.path.abspath(source), tokenizer, force)
    except SaveFolderLocked as e:
        raise ConfigError(str(e)) from None


def _weights_of(ckpt: str, meta: dict):
    """canonical_weights of a checkpoint, or a ConfigError that says the files are damaged."""
    from mega_depth.checkpoint.manifest import CorruptCheckpoint
    from mega_depth.checkpoint.weights import UnreadableShards, canonical_weights

    try:
        return canonical_weights(ckpt, meta)
    except UnreadableShards as e:
        raise ConfigError(f"checkpoint {ckpt}: {e}: the checkpoint is damaged; export an intact one (its save folder "
                          "falls back to one)") from None
    except CorruptCheckpoint as e:
        raise ConfigError(f"checkpoint {ckpt}: {e}: its weights do not match its recorded config; the checkpoint is "
                          "damaged or mega_depth.json was edited") from None
    except (OSError, RuntimeError, ValueError, KeyError, EOFError) as e:
        raise ConfigError(f"checkpoint {ckpt}: its weights cannot be read ({type(e).__name__}: {str(e)[:80]}): the "
                          "checkpoint is damaged; export an intact one (its save folder falls back to one)") from None
    except Exception as e:  # safetensors' own error type for a truncated file
        if type(e).__name__ != "SafetensorError":
            raise
        raise ConfigError(f"checkpoint {ckpt}: its weights file is truncated or damaged ({str(e)[:80]}); export "
                          "an intact checkpoint (its save folder falls back to one)") from None
