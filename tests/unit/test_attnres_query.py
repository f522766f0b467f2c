"""The input-dependent query's readings (docs/mechanisms.md §4), each against its formula written out, and the
depth-weight statistics that show whether its softmax saturates."""

import math

import pytest
import torch

from mega_depth.catalogue import mechanism_flags
from mega_depth.config import ConfigError, parse_args
from mega_depth.model.attnres import AttnResState
from mega_depth.model.base import STATS, TOKEN_SPREAD, ModelShape, Recorder
from mega_depth.model.config import residual_config
from mega_depth.model.registry import build

D, EPS = 16, 1e-6


def rmsnorm(x, gain):
    return x / x.pow(2).mean(-1, keepdim=True).add(EPS).sqrt() * gain


@pytest.mark.parametrize("source", ["newest", "sum"])
@pytest.mark.parametrize("scale", ["one", "rsqrt_d", "inv_d"])
@pytest.mark.parametrize("norm", [False, True])
def test_each_reading_is_its_formula(source, scale, norm):
    """q = c * [RMSNorm_q](W^Q RMSNorm_k(s)), s the newest source or the sum of all of them."""
    residual = residual_config({"mechanism": "attnres", "attnres_query": "input", "attnres_query_source": source,
                                "attnres_query_scale": scale, "attnres_query_norm": norm})
    mech = build(residual, ModelShape(2, D, 4, 4, EPS))
    mixer = mech._mixer(3, torch.float64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    sources = [torch.randn(5, 2, D, generator=g, dtype=torch.float64) for _ in range(3)]
    state = AttnResState(mech.attnres_layout, sources[:2], sources[2], 3)
    s = sources[2] if source == "newest" else sum(sources)
    q = rmsnorm(s, mixer.key_norm_weight) @ mixer.query.T
    if norm:
        q = rmsnorm(q, mixer.query_norm_weight)
    q = q * {"one": 1.0, "rsqrt_d": D ** -0.5, "inv_d": 1.0 / D}[scale]
    torch.testing.assert_close(mech._query(mixer, state), q)
    assert (mixer.query_norm_weight is not None) == norm


def test_readings_without_the_input_dependent_query_are_refused():
    cfg = parse_args(["--mock-data", "--residual", "attnres", "--attnres-query-source", "sum"])
    with pytest.raises(ConfigError, match="only apply to the input-dependent query; add --attnres-query input"):
        cfg.validate(1)


def test_a_benchmark_names_a_reading_as_a_variant_of_a_setting():
    assert mechanism_flags("attnres-input-query+attnres_query_scale=rsqrt_d+attnres_query_norm=true", 4) == [
        "--residual", "attnres", "--attnres-query", "input", "--attnres-query-scale", "rsqrt_d",
        "--attnres-query-norm"]
    with pytest.raises(ValueError, match="not OPTION=VALUE"):
        mechanism_flags("attnres-full+no_such_option=1", 4)


def test_the_recorder_keeps_entropy_logit_spread_and_the_spread_over_tokens():
    logits = torch.tensor([[0.0, 2.0], [0.0, 0.0], [0.0, -2.0]])  # [K=3 sources, 2 tokens]
    weights = torch.softmax(logits, 0)
    rec = Recorder()
    rec.add("attnres", 1.0, "sublayer 1", weights, softmax=True)
    entropy, logit_std = rec.figures["attnres" + STATS][(1.0, "sublayer 1")]
    uniform, peaked = math.log(3), float(-(weights[:, 1] * weights[:, 1].log()).sum())
    assert entropy == pytest.approx((uniform + peaked) / 2)
    assert logit_std == pytest.approx((0.0 + logits[:, 1].std(unbiased=False).item()) / 2)
    spread = rec.figures["attnres" + TOKEN_SPREAD][(1.0, "sublayer 1")]
    assert spread == pytest.approx(weights.std(1, unbiased=False).tolist())
    rec.add("mhc-H_pre", 1.0, "sublayer 1", weights)  # not a softmax over sources: means only
    assert "mhc-H_pre" + STATS not in rec.figures


def test_the_default_reading_is_inv_d_and_a_config_saved_before_it_keeps_its_scale():
    """--attnres-query input now defaults to the 1/d scale (docs/benchmarks.md); a checkpoint or export that
    does not record the option was trained without one and must load as it was trained, not silently rescaled."""
    from mega_depth.model.config import DecoderConfig

    cfg = parse_args(["--mock-data", "--residual", "attnres", "--attnres-query", "input"]).validate(1)
    assert cfg.residual.attnres_query_scale == "inv_d"
    saved = cfg.decoder_config(64).to_dict()
    assert saved["residual"]["attnres_query_scale"] == "inv_d"  # recorded from now on
    del saved["residual"]["attnres_query_scale"]  # as an older checkpoint or export holds it
    assert DecoderConfig.from_dict(saved).residual.attnres_query_scale == "one"
