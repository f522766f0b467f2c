"""The Megatron-core model against the identities of docs/mechanisms.md and against the plain decoder (one process,
gloo).

The plain decoder is what the Hugging Face export ships and the XLA trainer trains; the direct check below gives
both models the same weights with every mixing parameter and norm gain randomised (at initialisation AttnRes
already equals the baseline to ~1e-4, so a wrong block split or source order would not show there).
"""

import pytest
import torch

from fixtures import UNIT_MODEL, mechanism_flags
from mega_depth.catalogue import SETTINGS
from mega_depth.config import parse_args


@pytest.fixture(scope="module")
def megatron_world():
    from megatron.core import parallel_state

    from mega_depth.megatron import cpu_compat, te_absent
    from mega_depth.training.distributed import init_process_group

    cpu_compat.apply()  # explicit, as every entry point that starts Megatron on CPU does
    te_absent.apply()
    init_process_group()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield


def build(flags, seed=3):
    from megatron.core import tensor_parallel

    from mega_depth.megatron.builder import build_model_chunks

    cfg = parse_args(UNIT_MODEL + flags + ["--seed", str(seed)]).validate(1)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.training.seed)
    (model,) = build_model_chunks(cfg)
    return cfg, model.eval()


def logits(model, tokens):
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, position_ids, attention_mask=None)


@pytest.fixture(scope="module")
def baseline(megatron_world):
    return build(["--residual", "standard"])[1]


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def copy_baseline_weights(baseline, model):
    missing, unexpected = model.load_state_dict(baseline.state_dict(), strict=False)
    assert not unexpected
    assert all(model.decoder.mechanism.owns(name) for name in missing), missing
    return missing


@pytest.mark.parametrize("flags", [["--residual", "dca"], ["--residual", "dca", "--dca-last-k", "1"],
                                   ["--residual", "dca", "--dca-grn", "v1"]])
def test_dca_at_init_gives_the_baseline_logits(baseline, tokens, flags):
    _, model = build(flags)
    assert copy_baseline_weights(baseline, model)  # it has GRN parameters, at their init
    torch.testing.assert_close(logits(model, tokens), logits(baseline, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gqa", ["query", "group"])
def test_depth_attention_without_candidates_is_the_baseline(baseline, tokens, gqa):
    _, model = build(["--residual", "depth-attention", "--depth-attn-stride", "0", "--depth-attn-gqa", gqa])
    copy_baseline_weights(baseline, model)
    torch.testing.assert_close(logits(model, tokens), logits(baseline, tokens), rtol=1e-6, atol=1e-6)


def test_depth_attention_with_candidates_changes_the_model_by_its_mixing(baseline, tokens):
    """Layers 1 and 2 mix layer 0's values (stride 1): the logits move by far more than fp noise."""
    _, model = build(["--residual", "depth-attention", "--depth-attn-stride", "1"])
    copy_baseline_weights(baseline, model)
    moved = (logits(model, tokens) - logits(baseline, tokens)).abs().max().item()
    assert moved > 1e-2, moved


def test_attnres_first_sublayer_reads_the_embedding_and_mixers_start_at_zero(megatron_world, tokens):
    """With zero pseudo-queries every sublayer reads the uniform average of its sources (docs/mechanisms.md §4)."""
    _, model = build(["--residual", "attnres"])
    layer0 = model.decoder.layers[0]
    assert torch.count_nonzero(layer0.attn_mixer.query) == 0
    assert torch.count_nonzero(model.decoder.final_mixer.query) == 0
    seen = []
    hook = layer0.input_layernorm.register_forward_hook(lambda m, inp, out: seen.append(inp[0]))
    logits(model, tokens)
    hook.remove()
    embedding = model.embedding(tokens, torch.arange(16).expand_as(tokens))
    torch.testing.assert_close(seen[0], embedding)


def test_mixing_parameters_are_in_the_sharded_state_dict(megatron_world):
    """Distributed checkpoints hold the depth-mixing parameters, under layout-independent keys."""
    keys = lambda model: {v.key: v for v in model.sharded_state_dict().values() if hasattr(v, "key")}  # noqa: E731
    attnres = keys(build(["--residual", "attnres", "--attnres-num-blocks", "2"])[1])
    for key in ("decoder.layers.attn_mixer.query", "decoder.layers.mlp_mixer.key_norm_weight",
                "decoder.final_mixer.query"):
        assert key in attnres, sorted(attnres)
    assert attnres["decoder.layers.attn_mixer.query"].global_shape == (3, 32)  # stacked over the 3 layers
    dca = keys(build(["--residual", "dca"])[1])
    assert dca["decoder.final_grn.bias"].global_shape == (1, 32, 4)
    assert [dca[f"decoder.layers.{i}.grn_qkv.bias"].global_shape for i in range(3)] == \
        [(3, 32, 1), (3, 32, 2), (3, 32, 3)]


@pytest.mark.parametrize("mechanism", SETTINGS)
def test_megatron_model_equals_the_plain_decoder_with_trained_like_parameters(megatron_world, tokens, mechanism):
    """Same weights, every mixing parameter and norm gain randomised: the Megatron-core model and the plain
    decoder give the same logits (fp32, ~1e-4 relative). Ties the Megatron host layer, block, final mix and the
    state-dict adapter to the plain model that the export and the XLA path use."""
    from mega_depth.init import padded_vocab_size
    from mega_depth.model.decoder import CausalLM
    from mega_depth.model.state_dict_adapter import to_canonical

    cfg, model = build(mechanism_flags(3)[mechanism] if mechanism != "depth-attention" else
                       ["--residual", "depth-attention", "--depth-attn-stride", "1"])
    g, mech = torch.Generator().manual_seed(1), cfg.decoder_config().mechanism()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if mech.owns(name) or "layernorm" in name:
                scale = 0.3 / (p.shape[-1] ** 0.5) if p.dim() >= 2 else 0.3
                p.add_(scale * torch.randn(p.shape, generator=g))
    dc = cfg.decoder_config(padded_vocab_size(cfg.model.vocab_size))
    plain = CausalLM(dc).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = plain.load_state_dict(to_canonical(state, dc), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    # the start-up summary counts parameters on the plain decoder (meta device): the Megatron model's count
    from mega_depth.training.report import model_counts

    counts = model_counts(cfg, dc.vocab_size)
    assert counts.parameters == sum(p.numel() for p in model.parameters()), mechanism
    assert counts.mixing == sum(p.numel() for n, p in model.named_parameters() if mech.owns(n)), mechanism
    ref = logits(model, tokens).float()
    with torch.no_grad():
        out = plain(tokens).float()
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= 1e-4 * scale, (mechanism, (out - ref).abs().max().item(), scale)


MOE = ["--num-experts", "4", "--moe-layer-freq", "([0]*1+[1]*2)", "--moe-ffn-hidden-size", "48"]


@pytest.mark.parametrize("flags", [
    MOE + ["--residual", "attnres", "--attnres-num-blocks", "2", "--moe-shared-expert-intermediate-size", "32"],
    MOE + ["--residual", "mhc", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-router-topk", "3"],
    MOE + ["--residual", "standard", "--moe-router-topk", "1", "--moe-router-pre-softmax"],
], ids=["attnres-softmax-shared", "mhc-sigmoid-bias-top3", "standard-top1"])
def test_moe_megatron_model_equals_the_plain_decoder(megatron_world, tokens, flags):
    """Megatron's MoE layers (router, top-k, the expert bias, SwiGLU experts, a shared expert) and the plain
    decoder's (mega_depth/model/moe.py) give the same logits, with the router and the expert bias moved off their
    initialisation so that every token's choice matters."""
    from mega_depth.init import padded_vocab_size
    from mega_depth.model.decoder import CausalLM
    from mega_depth.model.state_dict_adapter import to_canonical

    cfg, model = build(flags)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:
                p.add_(torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    dc = cfg.decoder_config(padded_vocab_size(cfg.model.vocab_size))
    plain = CausalLM(dc).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = plain.load_state_dict(to_canonical(state, dc), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert sum(isinstance(m, torch.nn.Module) and type(m).__name__ == "MoEMLP" for m in plain.modules()) == 2
    from mega_depth.training.report import model_counts

    assert model_counts(cfg, dc.vocab_size).parameters == sum(p.numel() for p in model.parameters())
    ref = logits(model, tokens).float()
    with torch.no_grad():
        out = plain(tokens).float()
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= 1e-5 * scale, ((out - ref).abs().max().item(), scale)


@pytest.mark.parametrize("flags", [["--residual", "denseformer"],
                                   ["--residual", "denseformer", "--denseformer-dilation", "2"],
                                   ["--residual", "denseformer", "--denseformer-granularity", "sublayer"],
                                   ["--residual", "hc", "--hc-expansion", "1", "--no-hc-dynamic"]])
def test_identities_against_megatrons_own_layer_bit_for_bit(baseline, tokens, flags):
    """docs/mechanisms.md §3: DenseFormer at init, and one-stream HC with unit weights, are Megatron's own layer bit
    for bit (the depth-mixing host runs the same attention and MLP; its additions are exact)."""
    _, model = build(flags)
    copy_baseline_weights(baseline, model)
    assert torch.equal(logits(model, tokens), logits(baseline, tokens))


def test_mhc_at_init_is_megatrons_baseline_to_fp_tolerance(megatron_world, tokens):
    _, base = build(["--residual", "standard", "--norm-epsilon", "0"])
    _, model = build(["--residual", "mhc", "--norm-epsilon", "0"])
    copy_baseline_weights(base, model)
    torch.testing.assert_close(logits(model, tokens), logits(base, tokens), rtol=1e-5, atol=1e-5)


def test_sdpa_core_attention_equals_megatrons_unfused_attention(megatron_world, tokens):
    """The fast baseline's core attention (torch SDPA) against Megatron's own local DotProductAttention, GQA."""
    _, unfused = build(["--residual", "standard", "--attention-backend", "unfused"])
    _, sdpa = build(["--residual", "standard"])
    sdpa.load_state_dict(unfused.state_dict())
    from mega_depth.megatron.attention import SDPAttention

    assert isinstance(sdpa.decoder.layers[0].self_attention.core_attention, SDPAttention)
    assert not isinstance(unfused.decoder.layers[0].self_attention.core_attention, SDPAttention)
    a, b = logits(sdpa, tokens), logits(unfused, tokens)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def train_step_saved_bytes(model, tokens):
    """(bytes the forward saved for backward, loss, grads) of one forward/backward of `model` in training mode."""
    from mega_depth.kernels.saved_bytes import saved_for_backward_bytes

    model.train()
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    losses = []

    def step():
        loss = model(tokens, position_ids, attention_mask=None).float().logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())

    saved = saved_for_backward_bytes(step, model.parameters())
    return saved, losses[0], {n: p.grad.clone() for n, p in model.named_parameters()}


# The speed issue's activation-memory targets: saved-for-backward bytes over the baseline's, on the fused path
# (HC and mHC have none; their recomputation is checked against keeping).
SAVED_BYTES_TARGETS = {"attnres-full": 1.25, "attnres-block": 1.10, "dca": 1.25, "dca-2": 1.10,
                       "depth-attention": 1.05, "hc": None, "mhc": None}


@pytest.mark.parametrize("mechanism", list(SAVED_BYTES_TARGETS))
def test_fused_path_meets_the_memory_targets_and_trains_the_same(megatron_world, tokens, mechanism):
    """--mixing-impl triton (the fused Functions, their torch inner compute on a CPU) against the eager reference
    in the Megatron model, where the fast path also recomputes in backward what the mixing makes (DCA's q/k/v inputs
    and their projections' inputs, the two-phase merge, Depth-Attention's normalised keys, HC/mHC's coefficients
    and sublayer inputs): the same loss and
    gradients, fewer bytes saved for backward than eager, and within the target ratio to the baseline's;
    --no-mixing-recompute keeps those tensors instead."""
    baseline_saved, _, _ = train_step_saved_bytes(build(["--residual", "standard"])[1], tokens)
    eager_saved, eager_loss, eager_grads = train_step_saved_bytes(build(mechanism_flags(3)[mechanism])[1], tokens)
    fused_saved, fused_loss, fused_grads = train_step_saved_bytes(
        build(mechanism_flags(3)[mechanism] + ["--mixing-impl", "triton"])[1], tokens)
    torch.testing.assert_close(fused_loss, eager_loss, rtol=1e-6, atol=1e-6)
    for name, g in eager_grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item() + 1e-8,
                                   msg=lambda m: f"{mechanism} {name}: {m}")
    assert fused_saved < eager_saved, (mechanism, fused_saved, eager_saved)
    target = SAVED_BYTES_TARGETS[mechanism]
    assert target is None or fused_saved <= target * baseline_saved, (mechanism, fused_saved / baseline_saved)
    kept_saved, kept_loss, _ = train_step_saved_bytes(
        build(mechanism_flags(3)[mechanism] + ["--mixing-impl", "triton", "--no-mixing-recompute"])[1], tokens)
    torch.testing.assert_close(kept_loss, eager_loss, rtol=1e-6, atol=1e-6)
    if mechanism == "attnres-full":  # nothing to recompute: its fused Function already keeps only the sources
        assert kept_saved == fused_saved
    else:
        assert kept_saved > fused_saved, (mechanism, kept_saved, fused_saved)


def test_transformer_engine_by_default_only_where_the_mechanism_can_run_on_it(monkeypatch):
    """On a GPU with Transformer Engine importable the default spec is TE's, whose norm is fused into the QKV
    projection; DCA's three q/k/v inputs cannot take that, so DCA stays on the local spec (it would otherwise lose
    its pre-norm silently), and an explicit --transformer-impl transformer_engine is refused for it."""
    import sys
    import types

    from mega_depth.config import ConfigError
    from mega_depth.megatron.builder import transformer_impl

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    chosen = {name: transformer_impl(parse_args(UNIT_MODEL + flags)) for name, flags in mechanism_flags(3).items()}
    assert chosen.pop("dca") == chosen.pop("dca-2") == "local"
    assert set(chosen.values()) == {"transformer_engine"}, chosen
    with pytest.raises(ConfigError, match="--transformer-impl local"):
        parse_args(UNIT_MODEL + mechanism_flags(3)["dca"] + ["--transformer-impl", "transformer_engine"]).validate(1)


@pytest.mark.parametrize("clip", ["1.0", "0.01"])
def test_the_grad_norm_and_its_clip_stay_on_the_device_and_equal_the_exact_norm(megatron_world, clip):
    """Without TE or apex, Megatron's grad norm read one device norm per parameter to the host; here it is one
    _foreach_norm pass and a device scalar: no sync in the optimizer step, the norm equal to the fp64 norm of the
    gradients (1e-6), and the gradients clipped by min(1, clip / norm) on the device."""
    import os
    import sys

    from fixtures import ROOT
    from mega_depth.training.host_sync import SyncDetector

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from harness import megatron_run

    backend, sampler = megatron_run(UNIT_MODEL + ["--residual", "attnres", "--attnres-num-blocks", "2",
                                                  "--clip-grad", clip, "--lr", "1e-3", "--train-iters", "2"], 16)
    backend.forward_backward(sampler.microbatches(0))
    params = [p for m in backend.model for p in m.parameters()]
    before = [p.main_grad.double().clone() for p in params]
    expected = torch.sqrt(sum(g.pow(2).sum() for g in before)).item()
    with SyncDetector() as syncs:
        norm, applied = backend.update()
    assert isinstance(norm, torch.Tensor) and applied and list(syncs) == []
    assert float(norm) == pytest.approx(expected, rel=1e-6)
    factor = min(1.0, float(clip) / (expected + 1e-6))
    for p, g in zip(params, before):  # the clipped gradient the optimizer stepped with
        grad = p.main_grad if p.grad is None else p.grad
        torch.testing.assert_close(grad.double(), g * factor, rtol=1e-5, atol=1e-9)
    backend.close()


def test_a_captured_step_trains_as_the_eager_step(megatron_world):
    """--cuda-graph-impl local: the Megatron backend's step through StepGraph (its warm-up, capture and replays,
    the capture stood in for on CPU by step_graph.RerunCapture) gives the eager step's losses and weights, step for
    step, with 2 micro-batches a step; a change of micro-batch shape afterwards is refused with the fix."""
    import os
    import sys

    from fixtures import ROOT
    from mega_depth.megatron.step_graph import RerunCapture, StepGraph

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from harness import megatron_run

    flags = UNIT_MODEL + ["--residual", "attnres", "--attnres-num-blocks", "2", "--global-batch-size", "4",
                          "--micro-batch-size", "2", "--lr", "1e-2", "--train-iters", "6"]
    from mega_depth.config import ConfigError

    with pytest.raises(ConfigError, match="needs a GPU; drop it on this machine"):  # train(): one line, exit 2
        megatron_run(flags + ["--cuda-graph-impl", "local"], 64)
    eager, sampler = megatron_run(flags, 64)
    graphed, _ = megatron_run(flags, 64)
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class Capture(RerunCapture):  # the rotary table is made inside the capture, not read from Megatron's lru_cache
        def capture(self, fn):
            self.rotary_cached = hasattr(RotaryEmbedding.forward, "cache_info")
            return super().capture(fn)

    captures = []
    graphed.step_graph = StepGraph(2, torch.device("cpu"), new_capture=lambda: captures.append(Capture())
                                   or captures[-1])
    for step in range(6):
        batches = sampler.microbatches(step)
        losses = [b.forward_backward(batches) for b in (eager, graphed)]
        for b in (eager, graphed):
            b.update()
        assert losses[0] == losses[1], (step, losses)
    assert len(captures) == 1 and captures[0].reruns == 3  # steps 0-1 eager, 2 captured, 3-5 replayed
    assert not captures[0].rotary_cached and hasattr(RotaryEmbedding.forward, "cache_info")
    for p, q in zip(eager.model[0].parameters(), graphed.model[0].parameters()):
        assert torch.equal(p, q)
    short = [{k: v[:, :-1] if v.dim() == 2 else v for k, v in b.items()} for b in sampler.microbatches(6)]
    with pytest.raises(RuntimeError, match="changed shape or number.*--seq-length"):
        graphed.forward_backward(short)
    for b in (eager, graphed):
        b.close()


def test_a_cuda_capture_restores_the_stream_and_names_a_failure_in_one_line(monkeypatch):
    """step_graph.CudaCapture with torch.cuda's graph calls stood in for: the capture runs on the given stream, the
    previous stream is current again afterwards, even when the capture fails, and a failure (here an illegal sync
    inside the step, whose error capture_end's hides) becomes one line that names the cause and the flag to drop."""
    import contextlib

    from mega_depth.megatron import step_graph

    current, captured_on = ["default"], []

    @contextlib.contextmanager
    def graph(g, stream, capture_error_mode):
        previous, current[0] = current[0], stream
        captured_on.append((stream, capture_error_mode))
        try:
            yield
        except Exception:  # capture_end fails too, and torch then leaves the capture's stream current
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        current[0] = previous

    for name, value in (("CUDAGraph", lambda: "graph"), ("graph", graph), ("synchronize", lambda: None),
                        ("current_stream", lambda: current[0]), ("set_stream", lambda s: current.__setitem__(0, s))):
        monkeypatch.setattr(torch.cuda, name, value)
    capture = step_graph.CudaCapture("side")
    assert capture.capture(lambda: "losses") == "losses"
    assert captured_on == [("side", "thread_local")] and current[0] == "default"

    def syncs():
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    with pytest.raises(RuntimeError, match=r"could not be captured as a CUDA graph \(RuntimeError: operation not "
                                           r"permitted when stream is capturing\); drop --cuda-graph-impl local"):
        capture.capture(syncs)
    assert current[0] == "default"

    # a step whose error passes capture_end (a Python-level failure): the line names it, not the exception it was
    # handling when it raised (its __context__)
    @contextlib.contextmanager
    def graph_that_ends(g, stream, capture_error_mode):
        yield

    def fails_after_handling_one():
        try:
            {}["rope"]
        except KeyError:
            raise ValueError("the micro-batch changed shape")

    monkeypatch.setattr(torch.cuda, "graph", graph_that_ends)
    with pytest.raises(RuntimeError, match=r"\(ValueError: the micro-batch changed shape\)"):
        capture.capture(fails_after_handling_one)
