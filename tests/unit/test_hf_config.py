"""The Hugging Face export's token ids and the native import's refusals, on configs alone (no training): an export
names the special tokens its sentencepiece model has, whatever their ids, and a native folder whose config holds
what the import cannot represent is refused, never loaded as another model."""

import os

import pytest

from mega_depth.config import ConfigError


def _tokenizer(folder, **ids) -> str:
    import sentencepiece as spm

    text = folder / "text.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(200)))
    prefix = str(folder / "spm")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=prefix, vocab_size=48, hard_vocab_limit=False,
                                   minloglevel=2, **ids)
    return prefix + ".model"


def test_an_export_names_its_tokenizers_own_special_ids(tmp_path):
    from mega_depth.hf.io import _mega_depth_model, _native_model, special_tokens, token_ids
    from mega_depth.model.config import DecoderConfig

    (tmp_path / "llama").mkdir()
    (tmp_path / "other").mkdir()
    llama = special_tokens(_tokenizer(tmp_path / "llama", unk_id=0, bos_id=1, eos_id=2, pad_id=-1))
    assert llama["bos"] == ("<s>", 1) and llama["eos"] == ("</s>", 2) and llama["pad"] == ("</s>", 2)
    other = special_tokens(_tokenizer(tmp_path / "other", unk_id=0, pad_id=1, bos_id=2, eos_id=3))
    assert other["bos"] == ("<s>", 2) and other["eos"] == ("</s>", 3) and other["pad"] == ("<pad>", 1)
    ids = token_ids(other)
    assert ids == {"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 1}
    dc = DecoderConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                       vocab_size=64)
    for make in (_native_model, _mega_depth_model):
        config = make(dc, 64, ids).config
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (2, 3, 1)
    (tmp_path / "none").mkdir()
    with pytest.raises(ConfigError, match="has no end-of-sequence piece"):
        special_tokens(_tokenizer(tmp_path / "none", unk_id=0, bos_id=1, eos_id=-1, pad_id=-1))


LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64, "hidden_act": "silu",
         "rope_theta": 10000.0, "rms_norm_eps": 1e-5}


@pytest.mark.parametrize("edit, message", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 32.0}}, "RoPE scaling 'llama3'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "RoPE scaling 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 16}, "sliding-window attention"),
])
def test_a_native_config_the_import_cannot_represent_is_refused(edit, message):
    from mega_depth.hf.io import _native_config

    cfg = _native_config(dict(LLAMA), "plain")  # as it is: imported
    assert cfg.model.num_layers == 2 and cfg.model.rotary_base == 10000
    assert _native_config(dict(LLAMA, rope_scaling={"rope_type": "default"}), "plain").model.num_layers == 2
    with pytest.raises(ConfigError, match=message):
        _native_config(dict(LLAMA, **edit), os.path.join("some", "folder"))


@pytest.mark.parametrize("key, value", [("rms_norm_eps", 1e-2), ("rope_theta", 1e6), ("vocab_size", 999),
                                        ("qk_layernorm", False), ("head_dim", 16)])
def test_an_edited_config_json_that_disagrees_with_mega_depth_json_is_refused(key, value):
    """config.json says what transformers builds; mega_depth.json what the import builds: they must agree on
    every field both hold."""
    from mega_depth.config import parse_args
    from mega_depth.hf.io import _mega_depth_model, check_agreement
    from mega_depth.init import padded_vocab_size

    cfg = parse_args(["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
                      "--num-query-groups", "2", "--residual", "attnres", "--vocab-size", "100"]).validate(1)
    dc = cfg.decoder_config(padded_vocab_size(cfg.model.vocab_size))
    hf = _mega_depth_model(dc, 64, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}).config.to_dict()
    check_agreement(hf, cfg, "folder")  # as exported: they agree
    hf[key] = value
    with pytest.raises(ConfigError, match=f"config.json and mega_depth.json disagree \\({key} {value!r} vs"):
        check_agreement(hf, cfg, "folder")


def test_a_bf16_export_keeps_the_expert_bias_in_fp32(tmp_path):
    """Megatron keeps the routers' expert bias in fp32; a bf16 export (and a bf16 load of it) must not round it."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mega_depth.hf.io import _mega_depth_model, write_folder
    from mega_depth.model.config import DecoderConfig

    dc = DecoderConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                       vocab_size=64, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                       moe_layer_pattern=[0, 1], moe_router_score_function="sigmoid",
                       moe_router_enable_expert_bias=True)
    canonical = _mega_depth_model(dc, 64, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}).state_dict()
    key = next(k for k in canonical if k.endswith("e_score_correction_bias"))
    bias = torch.tensor([0.5 + 1e-4, -0.25 - 3e-5, 1e-3, 0.0])  # none of them a bf16 value but the last
    canonical[key] = bias
    (tmp_path / "tok").mkdir()
    out = write_folder(canonical, dc, str(tmp_path / "hf"), _tokenizer(tmp_path / "tok", unk_id=0, bos_id=1,
                                                                        eos_id=2, pad_id=-1), 64, {}, dtype="bf16")
    stored = load_file(os.path.join(out, "model.safetensors"))
    assert stored[key].dtype == torch.float32 and torch.equal(stored[key], bias)
    assert stored[key.replace("e_score_correction_bias", "weight")].dtype == torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16)
    assert torch.equal(model.state_dict()[key], bias)


def test_an_import_pads_only_the_padding_rows_of_a_vocabulary():
    """A foreign table of exactly its vocabulary's rows is padded to Megatron's multiple with zeros; one shorter
    than its own config's vocab_size lost real tokens' rows (transformers refuses it) and is refused, not
    zero-filled."""
    import torch

    from mega_depth.checkpoint.plain import check_weights
    from mega_depth.hf.io import _native_config
    from mega_depth.init import padded_vocab_size
    from mega_depth.model.decoder import CausalLM

    cfg = _native_config(dict(LLAMA, vocab_size=100), "plain")
    padded = padded_vocab_size(100)
    assert padded > 100
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(cfg.decoder_config(padded)).state_dict().items()}
    canonical = {k: torch.zeros(s) for k, s in shapes.items()}
    canonical["model.embed_tokens.weight"] = torch.ones(100, 32)
    canonical.pop("lm_head.weight", None)
    if not cfg.decoder_config(padded).tie_word_embeddings:
        canonical["lm_head.weight"] = torch.ones(100, 32)
    embedding = check_weights(canonical, cfg, "folder")["model.embed_tokens.weight"]
    assert embedding.shape[0] == padded and embedding[:100].eq(1).all() and embedding[100:].eq(0).all()
    canonical["model.embed_tokens.weight"] = torch.ones(70, 32)
    with pytest.raises(ConfigError, match="model.embed_tokens.weight has 70 rows but its config's vocab_size is 100"):
        check_weights(canonical, cfg, "folder")


def test_the_exported_loss_follows_the_trainers_token_count_under_gradient_accumulation():
    """transformers' Trainer passes num_items_in_batch to a forward that takes **kwargs and then does not divide the
    micro-batches' losses by the accumulation steps: the loss must be the window's token sum over that count, so two
    accumulated halves give the whole batch's gradient. Without it, the mean over the micro-batch's labels."""
    import torch

    from mega_depth.hf.io import _mega_depth_model
    from mega_depth.model.config import DecoderConfig, ResidualConfig

    dc = DecoderConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                       vocab_size=64, residual=ResidualConfig(mechanism="attnres"))
    model = _mega_depth_model(dc, 64, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}).float()
    ids = torch.randint(3, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 8:] = -100  # uneven label counts per row: a per-half mean would weigh the rows unequally
    labels[3, 5:] = -100
    out = model(input_ids=ids, labels=labels)
    mean = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
    torch.testing.assert_close(out.loss, mean)
    out.loss.backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    count = int((labels[:, 1:] != -100).sum())
    for half in (slice(0, 2), slice(2, 4)):  # as Trainer.training_step accumulates: no division by the steps
        model(input_ids=ids[half], labels=labels[half], num_items_in_batch=count).loss.backward()
    for accumulated, expected in zip((p.grad for p in model.parameters()), whole):
        torch.testing.assert_close(accumulated, expected, rtol=1e-4, atol=1e-6)


def test_a_cache_that_is_not_dynamic_is_refused_rather_than_read_wrong():
    """A StaticCache hands the attention its whole preallocated length of keys: the logits came out wrong (0.23 at
    most here) with no error. The dynamic cache (generate's default) gives the uncached logits."""
    import torch
    from transformers.cache_utils import DynamicCache, StaticCache

    from mega_depth.hf.io import _mega_depth_model
    from mega_depth.model.config import DecoderConfig, ResidualConfig

    dc = DecoderConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                       vocab_size=64, residual=ResidualConfig(mechanism="attnres"))
    model = _mega_depth_model(dc, 64, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}).float().eval()
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        cache = DynamicCache()  # filled in place
        prefix = model(input_ids=ids[:, :4], past_key_values=cache, use_cache=True).logits
        step = model(input_ids=ids[:, 4:], past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(torch.cat([prefix, step], 1), plain, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="takes a DynamicCache .*not StaticCache: drop cache_implementation"):
            model(input_ids=ids, past_key_values=StaticCache(config=model.config, max_cache_len=16), use_cache=True)
        with pytest.raises(ValueError, match="not StaticCache"):
            model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="static")
