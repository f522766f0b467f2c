"""mega_depth/kernels/grn.py: DCA's GRNs over the stack against mixing.grn_apply."""

import pytest
import torch
from kernel_checks import (SCALES, SourceGradAdds, bf16_matches_fp32, check, detached, gradcheck, interpreted, leaf,
                           opcheck, saves_only_inputs, sources_of)

from mega_depth.kernels.grn import dwa_mix, grn_apply_sources, grn_backward_into_op, grn_backward_op, grn_op
from mega_depth.model import mixing


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_values_and_gradients(path, version, k):
    """g = 3 instances (q, k, v); K = 4 is k-DCA's stack [x, sum, f_{t-1}, f_t]."""
    g, lead, d = 3, (5,), 12
    sources = sources_of(k, *lead, d)
    bias = leaf(g, k) if version == "v1" else leaf(g, d, k)
    proj = leaf(g, d) if version == "v3" else None
    check(lambda b, p, *s: grn_apply_sources(list(s), b, p, version),
          lambda b, p, *s: mixing.grn_apply(torch.stack(s), b, p, version),
          [bias, proj, *sources], f"grn {version} k={k}")


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_in_chunks_where_whole_rows_do_not_fit(path, monkeypatch, version):
    """The forward kernel that walks a token's sources in chunks of channels (wide rows, many sources), forced here:
    the sizes above fit in registers and take the whole-row kernel."""
    from mega_depth.kernels import grn

    assert grn._rows_fit(4, 12)
    monkeypatch.setattr(grn, "ROWS_IN_REGISTERS", 0)
    test_values_and_gradients(path, version, 3)


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_ragged_sizes(path, version):
    """Sizes that no block divides: 7 tokens (the backward's tiles take 2), 10 channels (its chunks and vectors take
    4 and 2 under the interpreter), 5 sources (blocks of 2), 3 instances (padded to 4)."""
    sources = sources_of(5, 7, 10)
    bias = leaf(3, 5) if version == "v1" else leaf(3, 10, 5)
    proj = leaf(3, 10) if version == "v3" else None
    check(lambda b, p, *s: grn_apply_sources(list(s), b, p, version),
          lambda b, p, *s: mixing.grn_apply(torch.stack(s), b, p, version),
          [bias, proj, *sources], f"grn {version} ragged")


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_backward_at_the_compiled_block_sizes(monkeypatch, version):
    """The backward's tiles as a GPU compiles them (32 lanes of 16-byte vectors, a token a warp, 4 tokens a program,
    2 sources a step at 3 instances), where the interpreter's own are 2 wide: the reshape of a chunk into lanes and
    vectors, the masked last chunk (300 channels) and the token tail (9 tokens) at the real shapes. Through the
    Triton kernels alone (the twins have no blocks)."""
    from mega_depth.kernels import common, grn

    if not interpreted():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1 (or triton is missing)")
    monkeypatch.setattr(common, "FORCE_TRITON", True)
    monkeypatch.setattr(grn, "interpreting", lambda: False)
    assert grn._gate_blocks(4, 3, 300, 4) == (2, 4, 32, 4) and grn._grad_blocks(4, 300, 3, 4, False) == (4, 4, 128)
    sources = sources_of(4, 9, 300)
    bias = leaf(3, 4) if version == "v1" else leaf(3, 300, 4, scale=0.1)
    proj = leaf(3, 300, scale=0.1) if version == "v3" else None
    check(lambda b, p, *s: grn_apply_sources(list(s), b, p, version),
          lambda b, p, *s: mixing.grn_apply(torch.stack(s), b, p, version),
          [bias, proj, *sources], f"grn {version} at the compiled block sizes")


def test_v3_gate_has_subgradient_one_at_zero(path):
    """proj starts at exactly zero: every gate sits on the kink, where clamp's subgradient (1) must be kept."""
    sources = sources_of(3, 2, 3, 12)
    bias, proj = leaf(3, 12, 3), torch.zeros(3, 12, requires_grad=True)
    check(lambda b, p, *s: grn_apply_sources(list(s), b, p, "v3"),
          lambda b, p, *s: mixing.grn_apply(torch.stack(s), b, p, "v3"),
          [bias, proj, *sources], "grn v3 at zero proj")
    (grad,) = torch.autograd.grad(grn_apply_sources(sources, bias, proj, "v3").sum(), [proj])
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_gradcheck(twin, scale, version):
    """v3 at input scales 1, 3, 10 with gates on both sides of the ReLU (the clamp fires for about half of them):
    finite differences stay away from the kink."""
    f64 = torch.float64
    sources = [(s * scale).detach().requires_grad_() for s in sources_of(3, 4, 6, dtype=f64)]
    bias = leaf(2, 3, dtype=f64) if version == "v1" else leaf(2, 6, 3, dtype=f64)
    proj = leaf(2, 6, dtype=f64) if version == "v3" else None
    if proj is not None:
        pre = torch.einsum("knd,gd->gkn", torch.stack(sources), proj)
        assert (pre < 0).any() and (pre > 0).any() and pre.abs().min() > 1e-4
    gradcheck(lambda b, p, *s: grn_apply_sources(list(s), b, p, version), [bias, proj, *sources],
              f"grn {version} scale={scale}")


def test_opcheck(twin):
    sources = sources_of(3, 2, 3, 8)
    for bias, proj, version in ((leaf(3, 8, 3), leaf(3, 8), 3), (leaf(3, 3), None, 1)):
        opcheck(grn_op, (sources, bias, proj, version))
        opcheck(grn_backward_op, (torch.randn(3, 2, 3, 8), detached(sources), bias.detach(),
                                  None if proj is None else proj.detach(), version))
        for adding in ([False] * 3, [True, False, True]):
            opcheck(grn_backward_into_op, (torch.randn(3, 2, 3, 8), detached(sources),
                                           [torch.randn(2, 3, 8) for _ in sources], adding, bias.detach(),
                                           None if proj is None else proj.detach(), version), eager_only=True)


def test_saves_only_its_inputs(path):
    sources = sources_of(4, 6, 12)
    saves_only_inputs(lambda b, p, *s: grn_apply_sources(s, b, p, "v3"), [leaf(3, 12, 4), leaf(3, 12), *sources])


def test_bf16(path):
    src = [torch.randn(6, 24) * (1 + i) for i in range(3)]
    bf16_matches_fp32(lambda b, p, *s: grn_apply_sources(s, b, p, "v3"),
                      lambda b, p, *s: mixing.grn_apply(torch.stack(s), b, p, "v3"), torch.randn(3, 24, 3),
                      torch.randn(3, 24), *src)


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_readers_of_one_source_add_into_one_buffer(path, version):
    """DCA's stack: each layer's GRNs read the entries before them, so an entry has one reader per later layer. The
    gradients equal autograd's sum and autograd adds none of them (kernels/grad_sink.py). The readers' slices make
    backward meet held and new buffers in one call (the last reader runs first and holds sources 1 and 2)."""
    lead, d = (5,), 12
    sources = sources_of(4, *lead, d)
    slices = ((0, 4), (0, 2), (1, 3))
    params = []
    for lo, hi in slices:  # 3 instances each
        k = hi - lo
        params += [leaf(3, k) if version == "v1" else leaf(3, d, k), leaf(3, d) if version == "v3" else None]

    def layers(grn):
        def run(*args):
            p, s = args[:6], args[6:]
            return tuple(grn(list(s[lo:hi]), p[2 * i], p[2 * i + 1]).sum(0) for i, (lo, hi) in enumerate(slices))
        return run

    fast = layers(lambda s, b, p: grn_apply_sources(s, b, p, version))
    check(fast, layers(lambda s, b, p: mixing.grn_apply(torch.stack(s), b, p, version)), [*params, *sources],
          f"grn readers {version}")
    outs = fast(*params, *sources)
    with SourceGradAdds(sources[0].shape) as adds:
        torch.autograd.grad(sum((o * torch.randn_like(o)).sum() for o in outs), sources)
    # the Triton kernels add in place; the torch twin (the CPU kernel) adds with aten inside the op
    assert adds.count == 0 or path == "torch", f"{adds.count} adds of a source's gradient"


@pytest.mark.parametrize("version", [1, 3])
def test_two_sources_with_one_gradient_buffer_both_arrive(path, version):
    """The kernel stores or adds a block of sources' gradients as one tile; two sources of one block that share a
    buffer would each read it before the other's store, and one gradient would be lost. The second one's must add
    to the first's, as one source at a time does."""
    sources = detached(sources_of(3, 2, 3, 8))
    bias = torch.randn(3, 3) if version == 1 else torch.randn(3, 8, 3)
    proj = torch.randn(3, 8) if version == 3 else None
    grad = torch.randn(3, 2, 3, 8)
    apart = [torch.zeros(2, 3, 8) for _ in sources]
    grn_backward_into_op(grad, sources, apart, [False] * 3, bias, proj, version)
    shared, last = torch.zeros(2, 3, 8), torch.zeros(2, 3, 8)
    grn_backward_into_op(grad, sources, [shared, shared, last], [False, True, False], bias, proj, version)
    torch.testing.assert_close(shared, apart[0] + apart[1])
    torch.testing.assert_close(last, apart[2])


@pytest.mark.parametrize("k", [1, 3])
def test_dwa_is_a_grn_v1_of_one_instance(path, k):
    """DenseFormer's depth-weighted average through the GRN kernels equals mixing.dwa, values and gradients (alpha
    included); at the identity init it returns the newest output bit for bit, in bf16 too."""
    sources, alpha = sources_of(k, 2, 3, 12), leaf(k)
    check(lambda a, *s: dwa_mix(list(s), a), lambda a, *s: mixing.dwa(torch.stack(s), a), [alpha, *sources],
          f"dwa k={k}")
    identity = torch.zeros(k)
    identity[-1] = 1.0
    low = [s.detach().to(torch.bfloat16) for s in sources]
    assert torch.equal(dwa_mix(low, identity), low[-1])
