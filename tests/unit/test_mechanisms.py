"""The Mechanism interface, checked for every registered mechanism and catalogue setting on the plain decoder:
options and flags come from the registry, parameter ownership, the pipeline payload (layout == entries, widths,
a state rebuilt from its entries continues identically), fast paths against the eager math."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mega_depth.catalogue import SETTINGS, mechanism_flags, residual_settings
from mega_depth.config import Config, parse_args
from mega_depth.model.config import DecoderConfig, ResidualConfig
from mega_depth.model.decoder import CausalLM, PlainHost, rope_cos_sin
from mega_depth.model.registry import MECHANISMS as REGISTRY, owner_of

LAYERS = 4


def decoder(name: str, seed: int = 0, layers: int = LAYERS, blocks: int = 3, **residual_fields) -> CausalLM:
    """A plain model of a catalogue setting with its mixing parameters randomised (so nothing sits at init);
    residual_fields set further ResidualConfig fields."""
    residual = ResidualConfig(**residual_settings(name, layers, attnres_num_blocks=blocks), **residual_fields)
    torch.manual_seed(seed)
    model = CausalLM(DecoderConfig(vocab_size=64, hidden_size=32, num_layers=layers, num_attention_heads=4,
                                   num_query_groups=2, ffn_hidden_size=64, residual=residual))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if owner_of(n):  # O(1) depth logits: matrices (the input-dependent query) scaled by their fan-in
                p.add_(0.3 * torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.dim() >= 2 else 1.0))
            elif p.dim() >= 2:
                p.normal_(0, 0.1)
    return model


def test_every_option_is_a_flag_and_a_yaml_key(tmp_path):
    fields = {f.name for f in dataclasses.fields(ResidualConfig)}
    for mech in REGISTRY.values():
        for opt in mech.options:
            assert opt.name in fields, opt.name
            value = opt.choices[-1] if opt.choices else (2 if opt.type is int else opt.default)
            if opt.type is bool:
                flags = [f"--no-{opt.name.replace('_', '-')}"]
                value = False
            else:
                flags = [f"--{opt.name.replace('_', '-')}", str(value)]
            assert getattr(parse_args(flags).residual, opt.name) == value, opt.name
    (tmp_path / "c.yaml").write_text("residual:\n  mechanism: attnres\n  attnres_heads: 2\n")
    assert parse_args(["--config", str(tmp_path / "c.yaml")]).residual.attnres_heads == 2


@pytest.mark.parametrize("name", SETTINGS)
def test_catalogue_settings_validate_and_own_exactly_their_parameters(name):
    cfg = parse_args(["--mock-data", "--num-layers", str(LAYERS), "--hidden-size", "32", "--num-attention-heads",
                      "4"] + mechanism_flags(name, LAYERS))
    cfg.validate(1)
    model = decoder(name)
    mech = model.model.mechanism
    owned = [n for n, _ in model.named_parameters() if mech.owns(n)]
    for n, _ in model.named_parameters():
        assert bool(owner_of(n)) == (n in owned), n  # no other mechanism claims them; nothing else is claimed
    assert bool(owned) == (mech.module_names != ())


@pytest.mark.parametrize("name", SETTINGS)
def test_payload_layout_matches_the_state_and_a_rebuilt_state_continues_identically(name):
    """At every layer boundary: the entries a state holds are exactly layout(boundary), with the declared
    widths, and state_from(entries) continues to the same output (what a pipeline hop or a recompute relies on)."""
    model = decoder(name).eval()
    mech, dc = model.model.mechanism, model.cfg
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    x = model.model.embed_tokens(ids).transpose(0, 1)  # [s, b, d]: the Megatron layout the payload uses
    rope = rope_cos_sin(torch.arange(6).expand(2, 6), dc.head_dim, dc.rotary_base, x.dtype)
    rope = tuple(r.transpose(0, 1) for r in rope)  # [s, b, 1, hn]

    class SeqFirst(PlainHost):  # the plain layer expects [b, s, d]; the payload is checked in [s, b, d]
        def attention_sublayer(self, h, k_in=None, v_in=None, value_mixer=None):
            t = lambda a: None if a is None else a.transpose(0, 1)  # noqa: E731
            mixer = None if value_mixer is None else (lambda rq, rk, v, qn, kn: tuple(o.transpose(0, 1) for o in (
                value_mixer(rq.transpose(0, 1), rk.transpose(0, 1), v.transpose(0, 1), qn, kn))))
            return super().attention_sublayer(t(h), t(k_in), t(v_in), mixer).transpose(0, 1)

        def mlp_sublayer(self, h):
            return super().mlp_sublayer(h)

    hosts = [SeqFirst(layer, tuple(r.transpose(0, 1) for r in rope), None) for layer in model.model.layers]
    with torch.no_grad():
        reference = mech.final_hidden(mech.run_layers(hosts, mech.initial_state(x)), model.model)
        state = mech.initial_state(x)
        for boundary in range(LAYERS + 1):
            entries, layout = mech.entries(state), mech.layout(boundary)
            # the same names (the hop packs them in the layout's order, so the dict's own order does not matter)
            names = [e.name for e in layout]
            assert sorted(entries) == sorted(names), (boundary, list(entries), names)
            for e in layout:
                assert mech.flat(e.name, entries[e.name]).shape[-1] == e.width, (boundary, e)
                assert mech.unflat(e.name, mech.flat(e.name, entries[e.name])).shape == entries[e.name].shape
            state = mech.state_from(dict(entries), boundary)  # as if it had crossed a hop here
            if boundary < LAYERS:
                state = mech.run_layers(hosts[boundary:boundary + 1], state)
        torch.testing.assert_close(mech.final_hidden(state, model.model), reference, rtol=1e-6, atol=1e-6)


FAST = [n for n in SETTINGS
        if residual_settings(n, LAYERS)["mechanism"] in ("attnres", "dca", "depth-attention", "hc", "mhc")]


# torch.compile on a CPU costs ~20-50 s per setting: the compiled twins are checked on the settings that call all
# eight of them (Block AttnRes: mix, phase 1, phase 2; 2-DCA: the GRN; Depth-Attention: its mix; mHC: the streams'
# read and write, Sinkhorn); the fused Functions on every fast setting.
COMPILED_TWINS = {"attnres-block": {"attnres_mix_sources", "attnres_phase1_sources", "attnres_phase2"},
                  "dca-2": {"grn_apply_sources"}, "depth-attention": {"depth_attention_mix"},
                  "mhc": {"streams_in", "streams_out", "mhc_projection", "mhc_projected_coefficients"}}
CASES = [(name, "triton") for name in FAST] + [(name, "compiled") for name in COMPILED_TWINS]
# Compiling 20 unrolled Sinkhorn iterations (forward and backward) costs about a minute on 2 cores; 4 iterations
# check the same compiled twin.
COMPILE_FIELDS = {"mhc": {"mhc_sinkhorn_iters": 4}}
# Each number of sources a twin is called with is one more graph to compile (Dynamo guards on a list's length): 2
# layers in 2 blocks call every twin that 4 layers in 3 do (Block AttnRes's phases 1 and 2 included: its second block
# starts at layer 1), at 2 to 4 sources, in less time (the four cases: 420 -> 259 s on 2 cores).
COMPILE_SHAPE = {"layers": 2, "blocks": 2}


@pytest.mark.parametrize("name, impl", CASES)
def test_fast_paths_equal_the_eager_math_in_values_and_gradients(name, impl):
    """--mixing-impl compiled / triton (the fused Functions; their torch inner compute on a CPU) route the mixing
    through the fast twins; the model's values and gradients must not move."""
    from mega_depth import kernels

    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    results = []
    fields = COMPILE_FIELDS.get(name, {}) if impl == "compiled" else {}
    shape = COMPILE_SHAPE if impl == "compiled" else {}
    called = set()
    for impl in ("eager", impl):
        model = decoder(name, seed=5, **shape, **fields)
        twins = kernels.select(impl)
        if impl == "compiled":  # which twins the model called (the smaller model must still call them all)
            twins = SimpleNamespace(**{k: (lambda *a, k=k, f=f, **kw: (called.add(k), f(*a, **kw))[1])
                                       for k, f in vars(twins).items()})
        model.model.mechanism.kernels = twins
        loss = model(ids).float().square().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert impl != "compiled" or COMPILED_TWINS[name] <= called, (name, sorted(called))
    (eager, eager_grads), (fast, fast_grads) = results
    torch.testing.assert_close(fast, eager, rtol=1e-5, atol=1e-6)
    for n, g in eager_grads.items():  # fp32 reassociation, relative to each gradient's scale
        torch.testing.assert_close(fast_grads[n], g, rtol=1e-4, atol=1e-4 * g.abs().max().item() + 1e-7,
                                   msg=lambda m: f"{name} {n}: {m}")


def test_weight_decay_rule_is_megatrons_plus_each_mechanisms_own():
    model = decoder("dca")
    mech = model.model.mechanism
    params = dict(model.named_parameters())
    assert mech.weight_decay_applies("model.layers.0.mlp.up_proj.weight", params["model.layers.0.mlp.up_proj.weight"])
    assert not mech.weight_decay_applies("model.norm.weight", params["model.norm.weight"])
    assert not mech.weight_decay_applies("model.layers.1.grn_qkv.bias", params["model.layers.1.grn_qkv.bias"])
    assert mech.weight_decay_applies("model.layers.1.grn_qkv.proj", params["model.layers.1.grn_qkv.proj"])


def test_a_config_without_the_mechanism_keeps_the_training_config_fields_apart():
    assert {"vp_cache", "mixing_impl"}.isdisjoint({f.name for f in dataclasses.fields(ResidualConfig)})
    assert Config().parallel.vp_cache and Config().model.mixing_impl is None  # triton on a GPU, else eager


def test_every_mechanism_brings_its_own_io_model():
    """tools/bench_throughput.py asks each mechanism for its forward I/O (Mechanism.io_units): none is missing,
    none is below the standard residual's 3 per sublayer, and the fused stream kernels move less than the
    unfused reference."""
    from mega_depth.catalogue import SETTINGS, residual_settings
    from mega_depth.model.base import ModelShape
    from mega_depth.model.config import residual_config
    from mega_depth.model.registry import build

    shape = ModelShape(6, 64, 4, 2, 1e-6)
    for name in SETTINGS:
        mech = build(residual_config(residual_settings(name, 6)), shape)
        assert mech.io_units(True) >= 3 * shape.num_sublayers, name
        assert mech.io_units(True) <= mech.io_units(False), name
    hc = build(residual_config(residual_settings("hc", 6)), shape)
    assert hc.io_units(True) < hc.io_units(False)
