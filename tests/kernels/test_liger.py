"""Liger-Kernel's fused ops as a GPU runs them in Megatron's local spec, against the eager math: the RMSNorm
(mega_depth/megatron/norm.py, Llama's casting) and the SwiGLU (mega_depth/megatron/swiglu.py)."""

import pytest
import torch
from kernel_checks import GPU, interpreted  # first: it switches the interpreter on before triton is imported
from kernel_checks import rms_normed as eager

from mega_depth.kernels import common
from mega_depth.megatron import norm, swiglu
from mega_depth.model import mixing


@pytest.fixture
def fused(monkeypatch):
    """The fused path, as a GPU runs it (on a CPU: under the interpreter, its gaps bridged)."""
    pytest.importorskip("liger_kernel", reason="Liger-Kernel is a test extra (pip install -e '.[test]')")
    if not interpreted():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    monkeypatch.setattr(common, "FORCE_TRITON", True)
    if not GPU:
        from liger_bridge import bridge_liger_for_the_interpreter

        bridge_liger_for_the_interpreter(monkeypatch.setattr)
    assert norm.fused_applies(torch.zeros(1))


def backward_passes(monkeypatch):
    """A list that gets an entry per torch.autograd.backward call: the step's own pass, and a checkpointed region's
    nested one."""
    passes = []
    backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **kw: (passes.append(1), backward(*a, **kw))[1])
    return passes


def host_norm_without_its_kernels(monkeypatch, d):
    """A host RMSNorm [d] (weight drawn in 0.5..1.5) and a list that gets an entry for each call of its own fused
    kernels (forward or backward), which then do not run; `host_norm.hooked` gets one for each run of the module's
    forward pre-hooks."""
    from mega_depth.megatron.norm import RMSNorm

    host_norm = RMSNorm(type("Config", (), {"params_dtype": torch.float32, "sequence_parallel": False}), d)
    with torch.no_grad():
        host_norm.weight.uniform_(0.5, 1.5)
    calls = []
    monkeypatch.setattr(norm, "fused_forward", lambda *a: calls.append(1))
    monkeypatch.setattr(norm, "fused_backward", lambda *a: calls.append(1))
    hooked(host_norm)
    return host_norm, calls


def hooked(module):
    """module.hooked: a list that gets an entry each time the module's forward pre-hooks run (where DeepSpeed ZeRO-3
    gathers a partitioned weight: a norm used without its call would read the empty partition)."""
    module.hooked = []
    module.register_forward_pre_hook(lambda m, args: m.hooked.append(1))


@pytest.mark.parametrize("shape", [(5, 64), (3, 2, 4, 24)])  # rows of d, and the q/k norms' [s, b, heads, hn]
def test_fused_norm_equals_the_eager_one_in_fp32(fused, shape):
    torch.manual_seed(0)
    x = (torch.randn(*shape) * 3).requires_grad_()
    w = (torch.rand(shape[-1]) + 0.5).requires_grad_()
    y = norm.rms_norm(x, w, 1e-6)
    ref = eager(x, w, 1e-6)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, (x, w), g), torch.autograd.grad(ref, (x, w), g)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_norm_equals_the_eager_one_to_bf16_rounding(fused):
    """bf16 in and out with fp32 math: the output and the input gradient within a bf16 rounding of the eager norm
    (the weight's gradient is checked in fp32 above: the interpreter's bf16 emulation of its partial sums is not
    the GPU's)."""
    torch.manual_seed(0)
    x = (torch.randn(6, 128) * 2).bfloat16().requires_grad_()
    w = (torch.rand(128) + 0.5).bfloat16().requires_grad_()
    y = norm.rms_norm(x, w, 1e-6)
    ref = eager(x, w, 1e-6)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -6, atol=2 ** -6)  # a few bf16 ulps
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, (x,), g)
    (rx,) = torch.autograd.grad(ref, (x,), g)
    torch.testing.assert_close(dx.float(), rx.float(), rtol=2 ** -6, atol=2 ** -6)


def test_the_eager_norm_runs_where_no_fused_kernel_does(monkeypatch):
    monkeypatch.setattr(common, "FORCE_TRITON", False)
    x, w = torch.randn(4, 8, device="cpu"), torch.rand(8, device="cpu")
    assert not norm.fused_applies(x)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6), eager(x, w, 1e-6), rtol=0, atol=0)


# bf16 on a GPU: the interpreter's bf16 casts inside this kernel give NaN (its emulation, not the kernel's math)
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if GPU else []))
def test_fused_swiglu_equals_silu_gate_times_up(fused, dtype):
    """Megatron's fc1 output [rows, 2f] = [gate | up]: silu(gate) * up, and its gradient, from one kernel each way."""
    torch.manual_seed(0)
    y = (torch.randn(5, 2 * 24) * 2).to(dtype).requires_grad_()
    out = swiglu.SwiGLU.apply(y)
    gate, up = torch.chunk(y, 2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    g = torch.randn_like(out)
    (dy,) = torch.autograd.grad(out, (y,), g)
    (ry,) = torch.autograd.grad(ref, (y,), g)
    torch.testing.assert_close(dy.float(), ry.float(), **(tol if dtype == torch.float32 else
                                                           dict(rtol=2 ** -6, atol=2 ** -6)))


def test_fused_norm_reads_a_head_of_a_fused_projection_in_place(fused):
    """A key split off a fused QKV projection ([s, b, groups, (r + 2) * hn] -> its hn columns: rows (r + 2) * hn
    apart) is normalised where it lies, and the input gradient is written once: no aten op copies or zero-fills a
    tensor of the key's size (Liger's own Function copies the key and zero-fills its gradient)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Traffic(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # (copy_ is not counted: the interpreter writes each launch's CPU tensors back with it)
            if isinstance(out, torch.Tensor) and out.numel() >= key_size and func.overloadpacket in (
                    torch.ops.aten.clone, torch.ops.aten.zeros_like, torch.ops.aten.zero_, torch.ops.aten.fill_,
                    torch.ops.aten.zeros, torch.ops.aten.new_zeros):
                self.ops.append(str(func))
            return out

    torch.manual_seed(0)
    s_, b, groups, r, hn = 3, 2, 2, 2, 24
    fused_qkv = (torch.randn(s_, b, groups, (r + 2) * hn) * 2).requires_grad_()
    key = fused_qkv[..., r * hn:(r + 1) * hn]
    key_size = key.numel()
    w = (torch.rand(hn) + 0.5).requires_grad_()
    g = torch.randn(s_, b, groups, hn)
    with Traffic() as traffic:
        y = norm.rms_norm(key, w, 1e-6)
        got = torch.autograd.grad(y, (fused_qkv, w), g)
    assert traffic.ops == [], traffic.ops
    ref = eager(key, w, 1e-6)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    for a, e in zip(got, torch.autograd.grad(ref, (fused_qkv, w), g)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_a_recomputed_sublayer_input_is_made_again_by_the_norm_without_a_nested_backward(fused, monkeypatch):
    """A fused mixing op's output under the host's pre-norm (`normed` of a `Recomputed` input, remakes=True): the
    norm keeps the op's inputs and rstd, not its output, makes the output again in its own backward (no nested
    backward pass, unlike checkpointing the region), and the values and gradients equal the eager norm of the
    op's output with autograd all the way. Where the input cannot be remade (remakes=False) the region is
    checkpointed."""
    from kernel_checks import saved_storages

    from mega_depth.kernels.streams import streams_in
    from mega_depth.megatron.norm import RMSNorm
    from mega_depth.model.base import Recomputed, normed

    torch.manual_seed(0)
    n, tokens, d = 3, 5, 64
    streams, weights = (torch.randn(n, tokens, d) * 2).requires_grad_(), torch.rand(n, tokens).requires_grad_()
    host_norm = RMSNorm(type("Config", (), {"params_dtype": torch.float32, "sequence_parallel": False}), d)
    with torch.no_grad():
        host_norm.weight.uniform_(0.5, 1.5)
    hooked(host_norm)
    passes = backward_passes(monkeypatch)
    g = torch.randn(tokens, d)
    inputs = (streams, weights, host_norm.weight)
    results = {}
    for remakes in (True, False):
        saved, y = saved_storages(lambda: normed(host_norm, Recomputed(streams_in, (streams, weights),
                                                                       remakes=remakes)))
        if remakes:
            assert host_norm.hooked == [1]  # the remade norm runs through the module's call, as the eager one
        passes.clear()
        y.backward(g)
        results[remakes] = (y.detach(), [t.grad.clone() for t in inputs], len(passes), saved)
        for t in inputs:
            t.grad = None
    y, grads, nested, saved = results[True]
    ref = eager(mixing.streams_in(streams, weights), host_norm.weight, host_norm.eps)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert nested == 1 and results[False][2] == 2  # the step's own pass; the checkpoint adds its nested one
    given = {t.untyped_storage().data_ptr() for t in inputs}
    assert {ptr: size for ptr, size in saved.items() if ptr not in given and size > tokens} == {}  # rstd only
    for got, want in zip(grads, results[False][1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_block_attnres_merge_is_normalised_in_its_own_kernel(fused, monkeypatch):
    """A `Recomputed` input with `normalised` (Block AttnRes's phase-2 merge): the host norm runs the mechanism's op
    that merges and normalises in one kernel each way, never the norm's own kernels (the merge is not written, read
    or made again), keeps nothing of the input's size beyond the sources (1 / RMS only), runs no nested backward,
    and equals the eager norm of the eager merge in values and in every gradient, the norm weight's included."""
    from kernel_checks import saved_storages

    from mega_depth.kernels.attnres_block import attnres_phase2, attnres_phase2_normed
    from mega_depth.model.base import Recomputed, normed

    torch.manual_seed(0)
    tokens, d, heads = 5, 64, 2
    m, z = torch.randn(tokens, heads).requires_grad_(), (torch.rand(tokens, heads) + 1).requires_grad_()
    o, partial = (torch.randn(tokens, d) * 2).requires_grad_(), torch.randn(tokens, d).requires_grad_()
    query, gain = torch.randn(d).requires_grad_(), (torch.rand(d) + 0.5).requires_grad_()
    host_norm, norm_kernels = host_norm_without_its_kernels(monkeypatch, d)
    inputs = (m, z, o, partial, query, gain, host_norm.weight)
    passes = backward_passes(monkeypatch)

    def merge(*sources):
        return attnres_phase2(*sources, query, gain, 1e-6, heads=heads)

    def merge_normed(weight, eps, *sources):
        return attnres_phase2_normed(weight, eps, *sources, query, gain, 1e-6, heads=heads)

    saved, y = saved_storages(lambda: normed(host_norm, Recomputed(merge, (m, z, o, partial), remakes=True,
                                                                   normalised=merge_normed)))
    g = torch.randn(tokens, d)
    y.backward(g)
    assert norm_kernels == [] and len(passes) == 1 and host_norm.hooked == [1]
    given = {t.untyped_storage().data_ptr() for t in inputs}
    assert {ptr: size for ptr, size in saved.items() if ptr not in given and size > tokens} == {}  # rstd only
    ref = eager(mixing.attnres_block_phase2(m, z, o, partial, query, gain, 1e-6, heads=heads), host_norm.weight,
                host_norm.eps)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    for t, want in zip(inputs, torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(t.grad, want, rtol=1e-5, atol=1e-5)


def test_an_hc_stream_read_is_normalised_in_its_own_kernel(fused, monkeypatch):
    """The same for HC / mHC's sublayer input (the streams' weighted sum, `streams_in_normed`), its streams an
    expanded embedding as in the first layer: no norm kernel, rstd only kept, one backward pass, and the values and
    gradients of the eager norm of the eager read."""
    from kernel_checks import saved_storages

    from mega_depth.kernels.streams import streams_in, streams_in_normed
    from mega_depth.model.base import Recomputed, normed

    torch.manual_seed(0)
    n, tokens, d = 4, 5, 64
    embedding, weights = torch.randn(tokens, d).requires_grad_(), torch.rand(n, tokens).requires_grad_()
    host_norm, norm_kernels = host_norm_without_its_kernels(monkeypatch, d)
    inputs = (embedding, weights, host_norm.weight)
    passes = backward_passes(monkeypatch)
    streams = embedding.unsqueeze(0).expand(n, tokens, d)
    saved, y = saved_storages(lambda: normed(host_norm, Recomputed(streams_in, (streams, weights), remakes=True,
                                                                   normalised=streams_in_normed)))
    g = torch.randn(tokens, d)
    y.backward(g)
    assert norm_kernels == [] and len(passes) == 1 and host_norm.hooked == [1]
    given = {t.untyped_storage().data_ptr() for t in inputs}
    assert {ptr: size for ptr, size in saved.items() if ptr not in given and size > tokens} == {}  # rstd only
    ref = eager(mixing.streams_in(embedding.unsqueeze(0).expand(n, tokens, d), weights), host_norm.weight,
                host_norm.eps)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    for t, want in zip(inputs, torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(t.grad, want, rtol=1e-5, atol=1e-5)


def test_dcas_projection_makes_its_inputs_again_without_a_nested_backward(fused, monkeypatch):
    """RemadeQKVProjection (DCA's fused path): the three inputs, made by a fused op from the sources, normalised and
    met by their rows of linear_qkv, equal the eager composition (project_separate, autograd throughout) in values
    and in the gradients of the sources, the mixing's and the norm's parameters and the weight, q_in's own gradient
    (DCA's MLP reads it) included; nothing of the inputs' size is kept beyond the sources, and backward runs no
    nested pass."""
    from types import SimpleNamespace

    from kernel_checks import saved_storages

    from mega_depth.kernels.grn import grn_apply_sources
    from mega_depth.megatron.qkv_projection import RemadeQKVProjection, project_separate

    torch.manual_seed(0)
    groups, per_group, hn, s_, b, k = 2, 2, 16, 3, 2, 3
    d = groups * per_group * hn
    sources = [(torch.randn(s_, b, d) * (1 + i)).requires_grad_() for i in range(k)]
    grn_bias = (torch.randn(3, d, k) * 0.3).requires_grad_()
    norm_weight = (torch.rand(d) + 0.5).requires_grad_()
    linear = SimpleNamespace(weight=(torch.randn(groups * (per_group + 2) * hn, d) * 0.1).requires_grad_())
    attention = SimpleNamespace(config=SimpleNamespace(sequence_parallel=False), world_size=1, tp_group=None,
                                linear_qkv=linear, num_query_groups_per_partition=groups,
                                num_attention_heads_per_partition=groups * per_group,
                                hidden_size_per_attention_head=hn)

    def make_inputs(*entries):  # q_in, k_in, v_in stacked
        return grn_apply_sources(list(entries), grn_bias, None, "v2")

    def remade():
        return RemadeQKVProjection.apply(attention, 1e-6, make_inputs, norm_weight, linear.weight, None,
                                         make_inputs(*sources), *sources)

    def composed():  # q_in (which DCA's MLP also reads) and the projections, autograd throughout
        q_in, k_in, v_in = make_inputs(*sources).unbind(0)
        return (q_in, *project_separate(attention, eager_rms, q_in, k_in, v_in))

    def eager_rms(x):
        return eager(x, norm_weight, 1e-6)

    leaves = [*sources, grn_bias, norm_weight, linear.weight]
    saved, got = saved_storages(remade)
    want = composed()
    grads = [torch.randn_like(t) for t in want]
    passes = backward_passes(monkeypatch)
    torch.autograd.backward(got, grads)
    assert len(passes) == 1
    got_grads = [t.grad for t in leaves]
    for got_t, want_t in zip(got, want):
        torch.testing.assert_close(got_t, want_t, rtol=1e-5, atol=1e-5)
    for got_g, want_g in zip(got_grads, torch.autograd.grad(want, leaves, grads)):
        torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-5)
    given = {t.untyped_storage().data_ptr() for t in leaves}
    assert {p: n for p, n in saved.items() if p not in given and n > 3 * s_ * b} == {}  # the rstd of 3 N rows


def test_norm_outputs_that_an_op_saves_are_made_again_from_the_norms_inputs(fused, monkeypatch):
    """Depth-Attention's fused path: within `outputs_made_again` the value mix saves what makes the normalised query
    and keys (the norms' inputs), not the normalised tensors, which are made again when backward reads them: the
    candidates' normalised keys die with the forward, no nested backward pass runs, and the values and gradients
    equal autograd's through the eager norms. A stored value of the normalised query's shape (the mix reads it
    through its gradient sink's alias) is saved as itself: a place is a tensor's view chain, not its shape (on
    meta tensors every storage address is 0)."""
    import gc
    import weakref

    from mega_depth.kernels.depth_attention import depth_attention_mix
    from mega_depth.megatron.norm import RMSNorm
    from mega_depth.model.base import norm_outputs_made_again

    torch.manual_seed(0)
    s_, b, hq, hkv, hn = 3, 2, 4, 2, 16
    config = type("Config", (), {"params_dtype": torch.float32, "sequence_parallel": False})
    q_norm, k_norm = RMSNorm(config, hn), RMSNorm(config, hn)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(0.5, 1.5)
    raw_q, raw_k = torch.randn(s_, b, hq, hn).requires_grad_(), torch.randn(s_, b, hkv, hn).requires_grad_()
    value = torch.randn(s_, b, hkv, hn).requires_grad_()
    cand_raw = [(torch.randn(s_, b, hkv, hn) * (1 + i)).requires_grad_() for i in range(2)]
    cand_values = [torch.randn(s_, b, hq, hn).requires_grad_() for _ in range(2)]  # the query's shape
    leaves = [raw_q, raw_k, value, *cand_raw, *cand_values, q_norm.weight, k_norm.weight]
    cand_keys = []

    def normalise_and_mix(qn, kn):
        query, key = qn(raw_q), kn(raw_k)
        keys = [kn(k) for k in cand_raw]
        cand_keys.extend(weakref.ref(k) for k in keys)
        return query, key, depth_attention_mix(query, key, value, keys, cand_values, "query")

    made_again = norm_outputs_made_again((q_norm, k_norm), raw_k)
    assert made_again is not None
    with made_again:
        got = normalise_and_mix(q_norm, k_norm)
    gc.collect()
    assert all(ref() is None for ref in cand_keys)  # kept by no node: made again in backward
    want = normalise_and_mix(lambda x: eager(x, q_norm.weight, q_norm.eps), lambda x: eager(x, k_norm.weight,
                                                                                          k_norm.eps))
    grads = [torch.randn_like(t) for t in want]
    passes = backward_passes(monkeypatch)
    torch.autograd.backward(got, grads)
    assert len(passes) == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for leaf_grad, w in zip([t.grad for t in leaves], torch.autograd.grad(want, leaves, grads)):
        torch.testing.assert_close(leaf_grad, w, rtol=1e-4, atol=1e-5)


class _DepthAttentionHost:
    """A host layer as far as Depth-Attention's value mixer goes: q/k norms (the host's RMSNorm, hooked), a key and
    value split off one fused projection (strided views), attention stood in for by a product of the normalised
    query, key and mixed values, an MLP by a linear map."""

    def __init__(self, index, d, hq, hkv, hn, generator):
        from mega_depth.megatron.norm import RMSNorm

        config = type("Config", (), {"params_dtype": torch.float32, "sequence_parallel": False})
        self.layer_index, self.heads = index, (hq, hkv, hn)
        self.q_norm, self.k_norm = RMSNorm(config, hn), RMSNorm(config, hn)
        for module in (self.q_norm, self.k_norm):
            with torch.no_grad():
                module.weight.uniform_(0.5, 1.5, generator=generator)
            hooked(module)
        self.w_q = (torch.randn(d, hq * hn, generator=generator) / d ** 0.5).requires_grad_()
        self.w_kv = (torch.randn(d, 2 * hkv * hn, generator=generator) / d ** 0.5).requires_grad_()
        self.w_o = (torch.randn(hq * hn, d, generator=generator) / d ** 0.5).requires_grad_()

    def parameters(self):
        return [self.w_q, self.w_kv, self.w_o, self.q_norm.weight, self.k_norm.weight]

    def attention_sublayer(self, x, value_mixer=None):
        hq, hkv, hn = self.heads
        raw_q = (x @ self.w_q).view(*x.shape[:-1], hq, hn)
        kv = (x @ self.w_kv).view(*x.shape[:-1], hkv, 2 * hn)
        query, key, mixed = value_mixer(raw_q, kv[..., :hn], kv[..., hn:], self.q_norm, self.k_norm)
        scores = (query * key.repeat_interleave(hq // hkv, -2)).sum(-1, keepdim=True)
        return (torch.sigmoid(scores) * mixed).flatten(-2) @ self.w_o

    def mlp_sublayer(self, x):
        return 0.5 * x


def test_depth_attentions_norms_are_folded_into_the_mix_kernel(fused, monkeypatch):
    """Depth-Attention on the fused path hands each mixing layer's query and key norms to the value mix
    (RMSNorm.folded, through the modules' calls: their hooks run), and the mix normalises this layer's raw query and
    key and the earlier layers' raw keys in its kernels, forward and backward: the host's norm kernels run for layer
    0 (no candidate) alone, and nothing is made again in backward. Without the query-norm fold (the ops without
    depth_attention_mix_qk_normed) the candidates' keys alone are folded: the host's norms run for every layer's
    query and key, and make the mixing layers' again in backward. Values and the gradients of the input,
    projections and both norms' weights equal the unfolded path's (the same fused ops without either fold: each key
    through the norm module, its output made again in backward, then the mix)."""
    from types import SimpleNamespace

    from mega_depth.catalogue import residual_settings
    from mega_depth.kernels import fast_functions
    from mega_depth.model.base import ModelShape
    from mega_depth.model.config import residual_config
    from mega_depth.model.registry import build

    layers, d, hq, hkv, hn = 3, 32, 4, 2, 8
    mech = build(residual_config(residual_settings("depth-attention", layers)), ModelShape(layers, d, hq, hkv, 1e-6))
    g = torch.Generator().manual_seed(0)
    hosts = [_DepthAttentionHost(i, d, hq, hkv, hn, g) for i in range(layers)]
    x = torch.randn(5, 2, d, generator=g).requires_grad_()
    leaves = [x] + [p for h in hosts for p in h.parameters()]
    norm_calls = []
    fused_forward = norm.fused_forward
    monkeypatch.setattr(norm, "fused_forward", lambda *a: (norm_calls.append(1), fused_forward(*a))[1])

    def run(*without):
        ops = vars(fast_functions())
        mech.kernels = SimpleNamespace(**{k: v for k, v in ops.items() if k not in without})
        mech.recompute_mixing = True
        norm_calls.clear()
        for h in hosts:
            h.q_norm.hooked.clear()
            h.k_norm.hooked.clear()
        state = mech.initial_state(x)
        for h in hosts:
            state = mech.layer_forward(h, state)
        out = mech.final_hidden(state, None)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), leaves)
        hooks = [(len(h.q_norm.hooked), len(h.k_norm.hooked)) for h in hosts]
        return out, grads, len(norm_calls), hooks

    want, want_grads, calls_unfolded, _ = run("depth_attention_mix_qk_normed", "depth_attention_mix_normed")
    folds = {"both": run(), "the candidates' keys": run("depth_attention_mix_qk_normed")}
    for what, (out, grads, calls, hooks) in folds.items():
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")
    # layer 0 has no candidate, layer 1 one (layer 0), layer 2 two: each module is called once a layer, and (the
    # candidates' fold) the key norm once more for the mix where the layer has candidates
    _, _, calls, hooks = folds["both"]
    assert hooks == [(1, 1)] * 3 and calls == 2, (hooks, calls)  # only layer 0's query and key through the kernels
    _, _, calls, hooks = folds["the candidates' keys"]
    assert hooks == [(1, 1), (1, 2), (1, 2)], hooks
    # 3 layers' query and key forward, and the two mixing layers' query and key made again in backward
    assert calls == 2 * layers + 2 * 2, calls
    # unfolded: the three candidate keys normalised by the module too, and made again in backward
    assert calls_unfolded == 2 * layers + 2 * 2 + 2 * 3, calls_unfolded
