"""Identities of SPEC.md section 5 on the Megatron-core model (one process, gloo)."""

import pytest
import torch

from mega_depth.config import parse_args

MODEL = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "16", "--vocab-size", "100", "--seed", "3", "--mock-data"]


@pytest.fixture(scope="module")
def megatron_world():
    from megatron.core import parallel_state

    from mega_depth.training.setup import init_distributed

    init_distributed()
    if not parallel_state.model_parallel_is_initialized():  # another module (the HF export) may have done it
        parallel_state.initialize_model_parallel(1, 1)
    yield


def build(flags):
    from megatron.core import tensor_parallel

    from mega_depth.megatron.builder import build_model_chunks

    cfg = parse_args(MODEL + flags).validate(1)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.training.seed)
    (model,) = build_model_chunks(cfg)
    return model.eval()


def logits(model, tokens):
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, position_ids, attention_mask=None)


@pytest.fixture(scope="module")
def baseline(megatron_world):
    return build(["--residual", "standard"])


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def copy_baseline_weights(baseline, model):
    missing, unexpected = model.load_state_dict(baseline.state_dict(), strict=False)
    assert not unexpected
    assert all(any(k in name for k in ("_mixer.", "grn")) for name in missing), missing
    return missing


@pytest.mark.parametrize("flags", [["--residual", "dca"], ["--residual", "dca", "--dca-last-k", "1"],
                                   ["--residual", "dca", "--dca-grn", "v1"]])
def test_dca_at_init_gives_the_baseline_logits(baseline, tokens, flags):
    model = build(flags)
    assert copy_baseline_weights(baseline, model)  # it has GRN parameters, at their init
    torch.testing.assert_close(logits(model, tokens), logits(baseline, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gqa", ["query", "group"])
def test_depth_attention_without_candidates_is_the_baseline(baseline, tokens, gqa):
    model = build(["--residual", "depth-attention", "--depth-attn-window", "0", "--depth-attn-gqa", gqa])
    copy_baseline_weights(baseline, model)
    torch.testing.assert_close(logits(model, tokens), logits(baseline, tokens), rtol=1e-6, atol=1e-6)


def test_depth_attention_with_candidates_changes_the_model(baseline, tokens):
    model = build(["--residual", "depth-attention", "--depth-attn-window", "1"])
    copy_baseline_weights(baseline, model)
    assert (logits(model, tokens) - logits(baseline, tokens)).abs().max() > 1e-3


def test_attnres_first_sublayer_reads_the_embedding_and_mixers_start_at_zero(megatron_world, tokens):
    """With zero pseudo-queries every sublayer reads the uniform average of its sources (SPEC.md section 1)."""
    model = build(["--residual", "attnres"])
    layer0 = model.decoder.layers[0]
    assert torch.count_nonzero(layer0.attn_mixer.query) == 0 and torch.count_nonzero(model.decoder.final_mixer.query) == 0
    seen = []
    hook = layer0.input_layernorm.register_forward_hook(lambda m, inp, out: seen.append(inp[0]))
    logits(model, tokens)
    hook.remove()
    embedding = model.embedding(tokens, torch.arange(16).expand_as(tokens))
    torch.testing.assert_close(seen[0], embedding)


def test_mixing_parameters_are_in_the_sharded_state_dict(megatron_world):
    """Distributed checkpoints hold the depth-mixing parameters, under layout-independent keys."""
    keys = lambda model: {v.key: v for v in model.sharded_state_dict().values() if hasattr(v, "key")}  # noqa: E731
    attnres = keys(build(["--residual", "attnres", "--attnres-num-blocks", "2"]))
    for key in ("decoder.layers.attn_mixer.query", "decoder.layers.mlp_mixer.key_norm_weight",
                "decoder.final_mixer.query"):
        assert key in attnres, sorted(attnres)
    assert attnres["decoder.layers.attn_mixer.query"].global_shape == (3, 32)  # stacked over the 3 layers
    dca = keys(build(["--residual", "dca"]))
    assert dca["decoder.final_grn.bias"].global_shape == (1, 32, 4)
    assert [dca[f"decoder.layers.{i}.grn_qkv.bias"].global_shape for i in range(3)] == \
        [(3, 32, 1), (3, 32, 2), (3, 32, 3)]
