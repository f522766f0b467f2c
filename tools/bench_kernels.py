"""Every depth-mixing op alone, forward and backward, at the sizes the 1B and 7B steps launch it: time, bytes, GB/s
and % of a copy of the same bytes, with the published peers side by side on the same function.

    python tools/bench_kernels.py [--shapes 1b,7b] [--ops attnres_mix,attnres_block,...] [--out kernels.json] \
        [--markdown]
    TRITON_INTERPRET=1 MEGA_DEPTH_KERNELS_FORCE_TRITON=1 python tools/bench_kernels.py --toy     # CPU, checks only
    python tools/bench_kernels.py --shapes 1b --tune mega_depth/kernels/tuned.json   # a GPU: tune the launches

A case is one op at the size a config's step launches it (tokens = micro-batch x sequence on one GPU, the config's
width, a middle layer's number of sources). Bytes are what the op must move at the least: each input read once and
each output written once, in the run's dtype (bf16); backward (which recomputes what forward did not keep) reads
the sources and the output gradient and writes the sources' gradients. The bandwidth references, in the same run:
a copy of the same bytes (read + write), and a sum of 8 sources into one (a mix with no arithmetic); and the host's
time to issue one tiny launch: an aten add, Triton's launcher alone, and a kernel of ours through its Python
(launch_references). Each op runs
on our kernels (mega_depth/kernels), on `torch.compile` of the eager math (mega_depth/model/mixing.py: the floor a
user gets for free), and on every peer that computes the same function (tools/kernel_peers.py): a peer's output
and gradients are checked equal to ours before it is timed; one that differs is reported so, not timed; one that
cannot run here is skipped with the reason. Ours runs once more, untimed: its row says whether it gave the same
bits again (deterministic: no parameter gradient summed by atomics). The torch.compile rows come last, after every
op's own and peer rows: compiling is the slow part, and a run cut short by its time box keeps the rest (--out is
written after every case). A time is a call's device time: the calls of a back-to-back series captured as one CUDA
graph and replayed, so no host time is in it (timed(); where a peer's calls cannot be captured, its eager series
time stands and its row says so). "host ms" is the host's time to issue one call eagerly: where it is above the
device's time, an eager step waits on the host for this op (--cuda-graph-impl local removes that wait).

--toy runs the same code at toy sizes in fp32 on the CPU under Triton's interpreter: every op and every peer that
can run there is run and checked, nothing is timed (timings on a CPU say nothing of a GPU).

--tune replaces the table: each kernel of our ops, at each setting around its launcher's guess (warps, and the
warps its register cap leaves resident: mega_depth/kernels/tuning.py) and at the table's entry, checked equal to
the shipped setting, then timed in the phase that launches it, in rounds; a setting at least 3 % faster than the
shipped one is written for this GPU's generation into the given table (merged; where it is the launcher's guess,
the entry is removed), every tried setting into <TABLE>.rows.json. Commit mega_depth/kernels/tuned.json, then run
tests/unit/test_kernels_aot.py: it compiles every entry for its target and fails on a spill.
"""

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, ContextManager, Dict, List, NamedTuple, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

EPS = 1e-6
NORM_EPS = 1e-5  # the host's RMSNorm (Megatron's --norm-epsilon default)
BF16_TOL = 2e-2  # relative error of bf16 results against ours (a few roundings of 2^-8)
SINKHORN_ITERS = 20  # mHC's default (--mhc-sinkhorn-iters)
OPS = ("attnres_mix", "attnres_mix_shared", "attnres_mix_deferred", "attnres_block", "attnres_block_last", "phase2",
       "phase2_normed", "grn", "grn_wide", "streams_out", "depth_attention", "mhc_maps", "mhc_projection",
       "mhc_sublayer", "mhc_sublayer_in_turn")
SHARED_READERS = 4  # the mixes over one set of sources in the attnres_mix_shared and _deferred cases


@dataclass
class Case:
    """One op at one size: make() -> its inputs (tensors: every floating one gets a gradient); run(*inputs) ->
    output; bytes moved at the least, forward and backward."""
    op: str
    shape: str
    what: str
    make: Callable
    run: Callable
    fwd_bytes: int
    bwd_bytes: int
    peers: Dict[str, Callable] = field(default_factory=dict)
    within: Callable[[], ContextManager] = contextlib.nullcontext  # the setting the case runs in, made and backward
    # the gradients (by index) that the math makes zero but for an epsilon: compared to GRADIENT_FLOOR of the case's
    # largest gradient, not to their own scale (rounding noise in both implementations)
    near_zero: Tuple[int, ...] = ()


def sizes(shape: str, toy: bool) -> Dict[str, int]:
    """tokens, width, and the sources a middle layer mixes, from the shipped configs (toy: tiny)."""
    if toy:
        return {"tokens": 6, "d": 32, "full_sources": 5, "blocks": 3, "last_blocks": 5, "queries": 3, "grn_sources": 3,
                "dca_sources": 5, "streams": 4, "heads": 4, "groups": 2, "candidates": 2}
    from mega_depth.config import parse_args

    cfg = parse_args(["--config", os.path.join(ROOT, "launch", "configs", f"{shape}-attnres.yaml"), "--mock-data"])
    layers = cfg.model.num_layers
    sublayers_per_block = 2 * layers // (cfg.residual.attnres_num_blocks or 8)
    return {"tokens": cfg.training.micro_batch_size * cfg.model.seq_length, "d": cfg.model.hidden_size,
            "full_sources": layers + 1, "blocks": (cfg.residual.attnres_num_blocks or 8) // 2,
            "last_blocks": cfg.residual.attnres_num_blocks or 8,  # the last block's completed ones, the embedding's too
            "queries": sublayers_per_block, "grn_sources": 4, "dca_sources": layers // 2 + 1, "streams": 4,
            "heads": cfg.model.num_attention_heads,
            "groups": cfg.model.num_query_groups or cfg.model.num_attention_heads,
            "candidates": 2}  # the deepest layers' Depth-Attention candidates (layers 0 and L/2)


def cases(shape: str, dtype, device, toy: bool, host_only: bool = False) -> List[Case]:
    """The ops at `shape`'s sizes (toy: tiny); host_only: its counts of sources, heads and streams with few tokens
    and a narrow width, for --host (the launchers' Python does not depend on those two)."""
    import torch

    from mega_depth.kernels.attnres_block import attnres_phase1_sources, attnres_phase2, attnres_phase2_normed
    from mega_depth.kernels.attnres_mix import attnres_mix_sources
    from mega_depth.kernels.depth_attention import depth_attention_mix_qk_normed
    from mega_depth.kernels.grn import grn_apply_sources
    from mega_depth.kernels.mhc_projection import mhc_projection
    from mega_depth.kernels.mhc_maps import mhc_projected_coefficients
    from mega_depth.kernels.streams import streams_out

    s = sizes(shape, toy)
    if host_only:
        s = dict(s, tokens=16, d=8 * s["heads"])
    n, d, item = s["tokens"], s["d"], torch.tensor([], dtype=dtype).element_size()
    row = n * d * item

    def rand(*shape_, scale=1.0, shift=0.0, seed=0):  # drawn on the device: the 1B sizes are GBs
        g = torch.Generator(device=device).manual_seed(seed)
        return (torch.randn(*shape_, generator=g, device=device) * scale + shift).to(dtype)

    def rows_of(count):  # `count` token rows [n, d]
        return [rand(n, d, seed=i) for i in range(count)]

    def query_and_gain(*lead):  # logits of about unit spread, as a trained query gives (one of std sqrt(d) = 45
        # makes the softmax a near-argmax that a bf16 rounding of the folded query flips at near-ties)
        return [rand(*lead, d, scale=d ** -0.5, seed=100), rand(*lead, d, scale=0.1, shift=1.0, seed=101)]

    k, b, q, gk, ns = s["full_sources"], s["blocks"], s["queries"], s["grn_sources"], s["streams"]
    full = Case("attnres_mix", shape, f"Full AttnRes mix, {k} sources",
                lambda: rows_of(k) + query_and_gain(),
                lambda *a: attnres_mix_sources(list(a[:-2]), a[-2], a[-1], EPS), (k + 1) * row, (2 * k + 1) * row)
    # Full AttnRes's sources are each read by many mixes (4 to 49 at 1B). R mixes over the same K sources, two ways
    # (model/base.DEFER_READERS). Added in turn (the default): each mix's backward reads its K sources, its output
    # gradient and output, and stores (the first reader) or reads and writes each source's gradient. Deferred to
    # the sinks (kernels/grad_sink.py, Sink.defer): each mix's backward leaves a few coefficients a token per source
    # instead, and each source's gradient is one pass over the R output gradients and the source
    # (attnres_source_grad). Forward, each mix reads its K sources and writes its output
    r = SHARED_READERS
    shared = Case("attnres_mix_shared", shape, f"Full AttnRes, {r} mixes over one set of {k} sources (gradients "
                  "added in turn)",
                  lambda: rows_of(k) + [rand(r, d, scale=d ** -0.5, seed=100), rand(d, scale=0.1, shift=1.0, seed=101)],
                  lambda *a: _shared_mixes(attnres_mix_sources, a), r * (k + 1) * row,
                  (r * (k + 2) + k * (2 * r - 1)) * row)
    deferred = replace(shared, op="attnres_mix_deferred", what=f"Full AttnRes, {r} mixes over one set of {k} sources "
                       f"(each source's gradient summed over its {r} readers at once)",
                       bwd_bytes=(r * (k + 2) + k * (r + 2)) * row, within=lambda: _deferring_from(r))
    # one block's whole Block AttnRes work, as the model does it: phase 1 of its q sublayers' queries over the b
    # completed blocks, then each sublayer's phase-2 merge of its partial sum (the first sublayer has none). Phase 1
    # alone is not one function across implementations: ours leaves (m, z, o) for the merges to normalise,
    # flash-attn-res normalises in phase 1 and merges from (o / z, LSE).
    def block_case(op, which, k):  # phase 1 over k completed blocks, then the q merges
        return Case(op, shape, f"Block AttnRes, {which}: phase 1 over {k} blocks x {q} queries, then the {q} merges",
                    lambda: rows_of(k) + [rand(n, d, seed=50 + i) for i in range(q - 1)] + query_and_gain(q),
                    lambda *a: _merged(attnres_phase1_sources, attnres_phase2, a, k), (k + 2 * q - 1) * row,
                    (2 * k + 3 * q - 2) * row)
    block = block_case("attnres_block", "one block", b)
    # the last block's: phase 1 over the 8 completed blocks at 1B (the embedding's one of them), where the whole-row
    # kernels' block tiles are 8 wide and the backward takes two passes (_one_pass), as for 4 of the step's 8 calls
    block_last = block_case("attnres_block_last", "the last block", s["last_blocks"])
    phase2 = Case("phase2", shape, "Block AttnRes phase 2 (with a partial sum)",
                  lambda: ([rand(n, 1, seed=1).float(), (rand(n, 1, seed=2).abs() + 1).float()] + rows_of(2)
                           + query_and_gain()),
                  lambda m, z, o, x, qv, gv: attnres_phase2(m, z, o, x, qv, gv, EPS), 3 * row, 5 * row)
    # what a GPU step runs for a Block AttnRes sublayer's input (the host's norm runs the op that merges and
    # normalises: megatron/norm.py): the same rows as the merge alone, at the step's one depth head (z then scales
    # the whole merged row, which the norm undoes: z's gradient is zero but for eps, `near_zero`). It
    # ran at two heads until 2026-12-07, so neither the table nor the tuner saw the step's kernel
    normed = Case("phase2_normed", shape, "Block AttnRes phase 2 (with a partial sum) and the sublayer's RMSNorm",
                  lambda: ([rand(n, 1, seed=1).float(), (rand(n, 1, seed=2).abs() + 1).float()] + rows_of(2)
                           + query_and_gain() + [rand(d, scale=0.1, shift=1.0, seed=102)]),
                  lambda m, z, o, x, qv, gv, w: attnres_phase2_normed(w, NORM_EPS, m, z, o, x, qv, gv, EPS),
                  3 * row, 5 * row, near_zero=(1,))  # z's
    grn = Case("grn", shape, f"DCA's GRN v3, {gk} sources x 3 instances",
               lambda: rows_of(gk) + [rand(3, d, gk, scale=0.1, seed=100), rand(3, d, scale=0.1, seed=101)],
               lambda *a: grn_apply_sources(list(a[:-2]), a[-2], a[-1], "v3"), (gk + 3) * row, (2 * gk + 3) * row)
    # full DCA's middle layer: its stack of every earlier block's output (the forward walks its rows in chunks,
    # twice; 2-DCA's four rows fit whole)
    wk = s["dca_sources"]
    grn_wide = replace(grn, op="grn_wide", what=f"DCA's GRN v3, {wk} sources x 3 instances (full DCA's middle layer)",
                       make=lambda: rows_of(wk) + [rand(3, d, wk, scale=0.1, seed=100), rand(3, d, scale=0.1,
                                                                                             seed=101)],
                       fwd_bytes=(wk + 3) * row, bwd_bytes=(2 * wk + 3) * row)
    streams = Case("streams_out", shape, f"HC streams out, {ns} streams",
                   lambda: ([rand(ns, n, d, seed=1), rand(n, d, seed=2), rand(ns, n, ns, scale=0.3, seed=3).float(),
                             rand(ns, n, scale=0.3, seed=4).float()]),
                   streams_out, (2 * ns + 1) * row, (3 * ns + 2) * row)
    hq, hkv, c, iters = s["heads"], s["groups"], s["candidates"], SINKHORN_ITERS
    hn = d // hq
    q_row, kv_row = n * hq * hn * item, n * hkv * hn * item  # a query (and a per-query-head value), a key
    # the layer's raw query and key and the candidates' raw keys, normalised by its query and key norms in the
    # kernels, as the step runs it: out the normalised query and key (the attention's) and the mixed values; back
    # their gradients (the attention's of the query and key join the mix's in the kernel)
    depth = Case("depth_attention", shape, f"Depth-Attention value mix, {c} candidates, per-query-head values, the "
                 "layer's query and key norms in the kernels (as the step runs it)",
                 lambda: ([rand(n, hq, hn, seed=1), rand(n, hkv, hn, seed=2), rand(n, hkv, hn, seed=3)]
                          + [rand(n, hkv, hn, seed=10 + j) for j in range(c)]
                          + [rand(n, hq, hn, seed=20 + j) for j in range(c)]
                          + [rand(hn, scale=0.1, shift=1.0, seed=30), rand(hn, scale=0.1, shift=1.0, seed=31)]),
                 lambda qv, kv, vv, *rest: depth_attention_mix_qk_normed(
                     rest[-1], NORM_EPS, rest[-2], NORM_EPS, qv, kv, vv, list(rest[:c]), list(rest[c:2 * c])),
                 3 * q_row + (3 + c) * kv_row + c * q_row,
                 4 * q_row + (5 + 2 * c) * kv_row + 2 * c * q_row)
    m = ns * ns + 2 * ns
    per_token = n * 4  # one fp32 value a token
    maps = Case("mhc_maps", shape, f"mHC's coefficients from the projection ({m} values a token), Sinkhorn "
                f"({iters} iterations) included; outputs concatenated",
                lambda: ([rand(n, m, seed=5).float(), (rand(n, 1, seed=6).abs() + 0.5).float(),
                          rand(m, scale=0.5, seed=7).float()]
                         + [rand(1, shift=1.0, seed=8 + i).float() for i in range(3)]),
                lambda *a: _concatenated(mhc_projected_coefficients(*a, iters)),
                (2 * m + 1) * per_token, (3 * m + 2) * per_token)
    project = Case("mhc_projection", shape, f"mHC's coefficient projection and RMS, {ns} streams -> {m}",
                   lambda: [rand(ns, n, d, seed=1), rand(m, ns * d, scale=0.02, seed=2)],
                   lambda st, phi: _rms_applied(mhc_projection(st, phi)), ns * row, 2 * ns * row)
    # one mHC sublayer's work on its streams, as the step runs it (model/mhc.py): the projection and its RMS, the
    # coefficients, the normalised read (the sublayer's input; here the sublayer is the identity) and the write.
    # The streams have three readers. Their gradients two ways (kernels/streams.DEFER_READERS): summed by the
    # streams' sink in one pass that makes phi's gradient too (the default), or added in turn by each reader's
    # backward. Bytes at the least: the streams read once, the input and the n new streams written; back, the
    # streams and the n new streams' gradients read, the streams' gradient written
    sublayer = Case("mhc_sublayer", shape, f"one mHC sublayer's stream work, {ns} streams (projection, coefficients, "
                    "normalised read, write; the streams' gradient summed by their sink)",
                    lambda: ([rand(ns, n, d, seed=1), rand(m, ns * d, scale=0.02, seed=2),
                              rand(m, scale=0.5, seed=7).float()]
                             + [rand(1, shift=1.0, seed=8 + i).float() for i in range(3)]
                             + [rand(d, scale=0.1, shift=1.0, seed=102)]),
                    _mhc_sublayer, (2 * ns + 1) * row, 3 * ns * row)
    in_turn = replace(sublayer, op="mhc_sublayer_in_turn", what=f"one mHC sublayer's stream work, {ns} streams "
                      "(the streams' gradient added in turn by each reader)", within=_streams_in_turn)
    from kernel_peers import peers_for

    out = [full, shared, deferred, block, block_last, phase2, normed, grn, grn_wide, streams, depth, maps, project,
           sublayer, in_turn]
    for case in out:
        case.peers = peers_for(case.op, EPS)
    return out


@contextlib.contextmanager
def _deferring_from(readers: int):
    """Sources of `readers` or more readers have their gradients summed by their sinks (model/base.DEFER_READERS)."""
    from mega_depth.model import base

    kept, base.DEFER_READERS = base.DEFER_READERS, readers
    try:
        yield
    finally:
        base.DEFER_READERS = kept


@contextlib.contextmanager
def _streams_in_turn():
    """HC / mHC's stream readers add their parts of the streams' gradient in turn (kernels/streams.DEFER_READERS)."""
    from mega_depth.kernels import streams

    kept, streams.DEFER_READERS = streams.DEFER_READERS, float("inf")
    try:
        yield
    finally:
        streams.DEFER_READERS = kept


def _mhc_sublayer(streams, phi, bias, alpha_pre, alpha_post, alpha_res, norm_weight, kernels: bool = True):
    """One mHC sublayer on its streams with the sublayer itself the identity (model/mhc.py's `sublayer`): the
    coefficients from the projection, the normalised read, the write of the read into the mixed streams. kernels:
    our ops, else the eager math (mixing.py and the host's eager norm)."""
    from mega_depth.model import mixing

    if kernels:
        from mega_depth.kernels.mhc_maps import mhc_projected_coefficients
        from mega_depth.kernels.mhc_projection import mhc_projection
        from mega_depth.kernels.streams import streams_in_normed, streams_out

        def read(s, w):
            return streams_in_normed(norm_weight, NORM_EPS, s, w)
    else:
        mhc_projection, mhc_projected_coefficients = mixing.mhc_projection, mixing.mhc_projected_coefficients
        streams_out = mixing.streams_out

        def read(s, w):
            return rms_normed(mixing.streams_in(s, w), norm_weight, NORM_EPS)
    proj, mean_square = mhc_projection(streams, phi)
    pre, post, res = mhc_projected_coefficients(proj, mean_square, bias, alpha_pre, alpha_post, alpha_res,
                                                SINKHORN_ITERS)
    return streams_out(streams, read(streams, pre), res.transpose(-1, -2).movedim(-2, 0), post)


def _shared_mixes(mix, args):
    """R mixes over the sources args[:-2], mix r with query args[-2][r] and the gain args[-1], a tuple."""
    queries, gain = args[-2], args[-1]
    return tuple(mix(list(args[:-2]), q, gain, EPS) for q in queries.unbind(0))


def _concatenated(coefficients):
    """H_pre, H_post and H_res as one vector: the benchmark times one output."""
    import torch

    return torch.cat([c.reshape(-1) for c in coefficients])


def _rms_applied(projection):
    """(x~ phi) rsqrt(mean(x~^2) + eps) [N, m] from (x~ phi, mean(x~^2)): the function Liger's mhc_mm_norm computes
    (DeepSeek's eps style)."""
    import torch

    proj, mean_square = projection
    return proj * torch.rsqrt(mean_square + EPS)


def _normed_mix(raw_query, raw_key, value, rest):
    """The depth_attention case's eager math: rest = candidates' raw keys, their values, the key norm's weight, the
    query norm's. -> (the normalised query, key, mixed values)."""
    import torch

    from mega_depth.model import mixing

    c = (len(rest) - 2) // 2
    query, key = rms_normed(raw_query, rest[-1], NORM_EPS), rms_normed(raw_key, rest[-2], NORM_EPS)
    keys = torch.stack([rms_normed(k, rest[-2], NORM_EPS) for k in rest[:c]])
    return query, key, mixing.depth_attention_mix(query, key, value, keys, torch.stack(rest[c:2 * c]))


def rms_normed(x, weight, eps):
    """The host's eager RMSNorm (megatron/norm.py): normalised in fp32, cast back, then scaled."""
    from mega_depth.megatron.norm import eager_rms_norm

    return eager_rms_norm(x, weight, eps)


def _merged(phase1, phase2, args, blocks: int):
    """Each sublayer's input [N, d] within one block, a tuple: phase 1 over the blocks args[:blocks] with the
    queries args[-2] and gains args[-1], then sublayer s's merge of its partial sum args[blocks + s - 1] (none for
    s = 0)."""
    queries, gains = args[-2], args[-1]
    partials = [None, *args[blocks:-2]]
    m, z, o = phase1(list(args[:blocks]), queries, gains, EPS)
    # unbound, as the model does (model/attnres.py): an index's backward would zero-fill all S rows for each
    return tuple(phase2(*state, x, qs, gs, EPS)
                 for state, x, qs, gs in zip(zip(m.unbind(0), z.unbind(0), o.unbind(0)), partials, queries, gains))


def reference(op: str):
    """The eager math of an op, called like Case.run (what torch.compile compiles)."""
    import torch

    from mega_depth.model import mixing

    # one function for the cases that differ only in a setting (how a gradient is taken) or in a size
    def shared(*a):
        return _shared_mixes(lambda sources, q, g, eps: mixing.attnres_mix(torch.stack(sources), q, g, eps), a)

    def grn(*a):
        return mixing.grn_apply(torch.stack(a[:-2]), a[-2], a[-1], "v3")

    def mhc_sublayer(*a):
        return _mhc_sublayer(*a, kernels=False)

    def block(*a):  # the blocks are what the q queries, their gains and q - 1 partial sums leave
        return _merged(lambda blocks, *rest: mixing.attnres_block_phase1(torch.stack(blocks), *rest),
                       mixing.attnres_block_phase2, a, len(a) - len(a[-2]) - 1)

    return {
        "attnres_mix": lambda *a: mixing.attnres_mix(torch.stack(a[:-2]), a[-2], a[-1], EPS),
        "attnres_mix_shared": shared,
        "attnres_mix_deferred": shared,
        "attnres_block": block,
        "attnres_block_last": block,
        "phase2": lambda m, z, o, x, q, g: mixing.attnres_block_phase2(m, z, o, x, q, g, EPS),
        "phase2_normed": lambda m, z, o, x, q, g, w: rms_normed(
            mixing.attnres_block_phase2(m, z, o, x, q, g, EPS), w, NORM_EPS),
        "grn": grn,
        "grn_wide": grn,
        "streams_out": lambda st, y, mix, post: mixing.streams_out(st, y, mix, post),
        "depth_attention": lambda qv, kv, vv, *rest: _normed_mix(qv, kv, vv, rest),
        "mhc_maps": lambda *a: _concatenated(mixing.mhc_projected_coefficients(*a, SINKHORN_ITERS)),
        "mhc_projection": lambda st, phi: _rms_applied(mixing.mhc_projection(st, phi)),
        "mhc_sublayer": mhc_sublayer,
        "mhc_sublayer_in_turn": mhc_sublayer,
    }[op]


class Timing(NamedTuple):
    seconds: float  # a call's device time: replayed from a CUDA graph of back-to-back calls, else series_seconds
    host_seconds: float  # the host's time to issue one call (Python, autograd, the launches)
    series_seconds: float  # a call's time within an eager series of back-to-back calls (the host's where it lags)
    graphed: Optional[str] = None  # "yes", or why the calls could not be captured (then seconds = series_seconds)
    host_profile: Optional[List[list]] = None  # --host-profile: where that time went (host_profile())


HOST_PROFILE = False  # --host-profile: each timed call's host time by function, on the GPU machine's own host
KERNEL_BREAKDOWN = False  # --kernel-breakdown: our rows list each phase's kernels with their device times


def host_profile(fn, repeats: int, top: int = 12) -> List[list]:
    """[function, calls a call, microseconds a call in the function itself] of the `top` functions by own time,
    over `repeats` calls of fn under cProfile: where the host's time to issue a call goes (Python, autograd, the
    allocators, Triton's launcher, the driver's calls). The development VM records launches instead of running them;
    this is the real launch path's."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, ...)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [[f"{os.path.basename(file)}:{line}({name})", calls / repeats, 1e6 * own / repeats]
            for (file, line, name), (_, calls, own, _, _) in rows]


PASSES = ("ours", "peers", "torch.compile")  # the table's rows, in the order they are measured
SERIES = 3  # timed series per measurement; the median series counts


def timed(fn, device, repeats: int, series: bool = True) -> Optional[Timing]:
    """A call's device time on a GPU, and the host's time to issue one; None on a CPU (not timed).

    The host's: each of SERIES series runs fn `repeats` times back to back between two CUDA events, with no sync
    between the calls, after a warm-up; the host queues ahead of the device as in a training step, so a series
    call's time is the device's where the host keeps ahead and the host's where it cannot. On the H200
    (2026-11-30, second session) every op of ours took as long to issue as to run, so the series measured the host.
    The device's: the same `repeats` calls captured as one CUDA graph (graphed_seconds), replayed SERIES times:
    the kernels back to back with no host in between, what a captured training step (--cuda-graph-impl local)
    runs. Where a capture fails (a peer that syncs), the series time stands, and the row says why. series=False
    (the tuner, which compares device times only): the eager series runs only where the capture fails."""
    import torch

    if device.type != "cuda":
        fn()
        return None
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graphed = None
    if not series:
        device_seconds, graphed = graphed_seconds(fn, device, repeats)
        if device_seconds is not None:
            return Timing(device_seconds, float("nan"), float("nan"), graphed)
    runs = []
    for _ in range(SERIES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        host = (time.perf_counter() - began) / repeats
        end.synchronize()
        runs.append((start.elapsed_time(end) / 1e3 / repeats, host))
    seconds, host = sorted(runs)[len(runs) // 2]
    if graphed is None:  # (else the capture failed above)
        device_seconds, graphed = graphed_seconds(fn, device, repeats)
    median = Timing(seconds if device_seconds is None else device_seconds, host, seconds, graphed)
    if HOST_PROFILE:
        median = median._replace(host_profile=host_profile(fn, repeats))
        torch.cuda.synchronize()
    return median


_POOL = None  # the CUDA graph memory pool every timing's capture shares


def graphed_seconds(fn, device, repeats: int) -> Tuple[Optional[float], str]:
    """(a call's device time, "yes") from `repeats` calls of fn captured as one CUDA graph and replayed SERIES
    times (the median replay), or (None, why) where the capture failed. Our ops' pointer tables come from a buffer
    filled after the capture (kernels/graph_tables.py), sized by one eager call's tables."""
    import torch

    from mega_depth.kernels import graph_tables

    global _POOL
    before = graph_tables.Counter.entries
    fn()
    entries = (graph_tables.Counter.entries - before) * repeats
    tables = graph_tables.CapturedTables(device, entries) if entries else None
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream()  # (main's side stream: the stream a backward's forward ran on)
    _POOL = _POOL or torch.cuda.graph_pool_handle()  # one pool: a failed capture keeps its pool for good
    torch.cuda.synchronize()
    try:
        with graph_tables.capturing(tables) if tables else contextlib.nullcontext(), \
                torch.cuda.graph(graph, pool=_POOL, stream=stream, capture_error_mode="thread_local"):
            for _ in range(repeats):
                fn()
    except Exception as exc:  # a call that syncs or copies from the host cannot be captured
        torch.cuda.set_stream(stream)  # (a capture that fails at its end leaves the capture's stream current)
        torch.cuda.synchronize()
        cause = exc.__context__ or exc  # capture_end's error hides the call's that invalidated the capture
        return None, f"not captured: {type(cause).__name__}: {str(cause).splitlines()[0][:120] if str(cause) else ''}"
    if tables:
        tables.fill()
    graph.replay()  # (the first replay uploads the graph)
    times = []
    for _ in range(SERIES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / repeats)
    del graph
    return sorted(times)[len(times) // 2], "yes"


def timing_fields(fwd: Optional[Timing], bwd: Optional[Timing]) -> dict:
    """A row's times: fwd_s / bwd_s (None where untimed) and the host's share, fwd_host_s / bwd_host_s."""
    fields = {}
    for phase, t in (("fwd", fwd), ("bwd", bwd)):
        fields[f"{phase}_s"] = None if t is None else t.seconds
        fields[f"{phase}_host_s"] = None if t is None else t.host_seconds
        fields[f"{phase}_series_s"] = None if t is None else t.series_seconds
        fields[f"{phase}_graphed"] = None if t is None else t.graphed
        if t is not None and t.host_profile is not None:
            fields[f"{phase}_host_profile"] = t.host_profile
    return fields


def outputs(out) -> list:
    """An op's outputs as a list: one tensor, or a tuple of them (the Block AttnRes block: one per sublayer)."""
    return list(out) if isinstance(out, (tuple, list)) else [out]


def output_gradient(out) -> list:
    """The gradients fed to an op's outputs: the same draws for every implementation and run."""
    import torch

    return [torch.randn(o.shape, generator=torch.Generator(device=o.device).manual_seed(7 + i),
                        device=o.device).to(o.dtype) for i, o in enumerate(outputs(out))]


def forward_backward(run, inputs, device, repeats):
    """(output, gradients, forward seconds, backward seconds) of run on leaves made from inputs."""
    import torch

    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    fwd = timed(lambda: run(*leaves), device, repeats)
    out = outputs(run(*leaves))
    go = output_gradient(out)
    wanted = [t for t in leaves if t.requires_grad]
    bwd = timed(lambda: torch.autograd.grad(out, wanted, go, retain_graph=True), device, repeats)
    grads = torch.autograd.grad(out, wanted, go, retain_graph=True)
    return [o.detach() for o in out], [g.detach() for g in grads], fwd, bwd


def run_twice_equal(run, inputs, out, grads) -> bool:
    """Whether one more untimed forward and backward of run gives the same bits as (out, grads): the parameter
    gradients are summed in order (per-program partial sums, common.sum_rows), never by atomics whose order, and
    so whose fp32 rounding, varies from run to run. A GPU is where that can fail; on a CPU it checks the code
    path."""
    import torch

    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    again = outputs(run(*leaves))
    grads_again = torch.autograd.grad(again, [t for t in leaves if t.requires_grad], output_gradient(again))
    return all(torch.equal(a, b) for a, b in zip(again + list(grads_again), out + list(grads)))


def agree(a, b, tol: float, floor: float = 0.0) -> Optional[str]:
    """None when a equals b to tol (relative to b's scale, or to `floor` where that is larger), else what
    differs."""
    scale = max(b.float().abs().max().item(), floor) or 1.0
    err = (a.float() - b.float()).abs().max().item() / scale
    return None if err <= tol else f"max relative error {err:.2e} > {tol:g}"


# A gradient that the math makes zero but for an epsilon (a case's `near_zero`: Block AttnRes's normalised merge with
# one depth head, where z scales the whole merged row and the norm undoes it) is rounding noise in both
# implementations: it is compared relative to this share of the case's largest gradient, not to its own scale.
# Every other gradient keeps its own scale (a parameter's gradient, summed over thousands of tokens, is far larger
# than a token row's, and a floor from it would wave the rows' errors through).
GRADIENT_FLOOR = 1e-3


def first_difference(out, grads, ref_out, ref_grads, tol: float, near_zero: Tuple[int, ...] = ()) -> Optional[str]:
    """None when the output and every gradient equal the reference's to tol, else which one differs and by how
    much. near_zero: the gradients held to GRADIENT_FLOOR of the largest one instead."""
    if len(out) != len(ref_out):
        return f"{len(out)} outputs, not {len(ref_out)}"
    floor = GRADIENT_FLOOR * max((g.float().abs().max().item() for g in ref_grads if g.numel()), default=0.0)
    named = ([("output" if len(out) == 1 else f"output {i}", o, r, 0.0) for i, (o, r) in enumerate(zip(out, ref_out))]
             + [(f"gradient {i}", g, r, floor if i in near_zero else 0.0)
                for i, (g, r) in enumerate(zip(grads, ref_grads))])
    return next((f"{name}: {p}" for name, a, b, least in named for p in [agree(a, b, tol, least)] if p), None)


def _fp32(t):
    return t.float() if t.is_floating_point() else t


def measure(case: Case, device, repeats: int, tol: float) -> List[dict]:
    """One row per implementation of the case: ours, then each peer."""
    return [measure_ours(case, device, repeats, tol)] + measure_peers(case, device, repeats, tol)


def kernel_breakdown(run, inputs, device) -> dict:
    """{fwd_kernels, bwd_kernels}: one call of each phase under torch.profiler, its kernels as [name, device us,
    launches], longest first: which of an op's kernels holds its time (the GRN's backward is three kernels and
    sums of partials). On a CPU, the top-level operators instead (the plumbing's dry run: the interpreter's kernels
    are Python, not device work)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from profile_step import intervals

    gpu = device.type == "cuda"
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    wanted = [t for t in leaves if t.requires_grad]
    calls = {"fwd": lambda: run(*leaves)}
    found = {}
    for phase in ("fwd", "bwd"):
        if phase == "bwd":  # a forward's graph of its own, kept for the one profiled backward
            out = outputs(run(*leaves))
            go = output_gradient(out)
            calls["bwd"] = lambda: torch.autograd.grad(out, wanted, go, retain_graph=True)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
            calls[phase]()
            if gpu:
                torch.cuda.synchronize()
        totals: Dict[str, list] = {}
        for start, end, name in intervals(prof.events(), gpu):
            entry = totals.setdefault(name, [name, 0.0, 0])
            entry[1] += end - start
            entry[2] += 1
        found[f"{phase}_kernels"] = sorted(totals.values(), key=lambda e: -e[1])
    return found


def measure_ours(case: Case, device, repeats: int, tol: float) -> dict:
    """Our row of the case: timed, run twice for its bits, and checked against the eager math in fp32."""
    inputs = case.make()
    out, grads, fwd, bwd = forward_backward(case.run, inputs, device, repeats)
    same = run_twice_equal(case.run, inputs, out, grads)
    row = dict(impl="mega_depth", **timing_fields(fwd, bwd), deterministic=same,
               status="ok" if same else "ok, but a second run differs in its bits (not deterministic)")
    if KERNEL_BREAKDOWN:
        row.update(kernel_breakdown(case.run, inputs, device))
    # the reference is the eager math in fp32: in bf16 its own reductions (a gain's gradient summed over 8,192
    # tokens) round further from the truth than our fp32-accumulating kernels do
    ref_out, ref_grads, _, _ = forward_backward(reference(case.op), [_fp32(t) for t in inputs], device, 1)
    problem = first_difference(out, grads, ref_out, ref_grads, tol, case.near_zero)
    if problem:  # said in the row (and the exit status), and the table goes on: GPU time is scarce
        row["status"] = f"differs from the fp32 eager math: {problem}"
    return _of_case(row, case)


def measure_peers(case: Case, device, repeats: int, tol: float) -> List[dict]:
    """One row per peer: checked against our output and gradients, then timed; a peer that cannot run here, or
    computes another function, is said and not timed."""
    inputs = case.make()
    out, grads, _, _ = forward_backward(case.run, inputs, device, 1) if case.peers else (None, None, None, None)
    rows = []
    for name, peer in case.peers.items():
        row = dict(impl=name, **timing_fields(None, None))
        peer_inputs = peer.prepare(inputs) if peer.prepare else inputs
        try:
            p_out, p_grads, _, _ = forward_backward(peer.run, peer_inputs, device, 1)
            p_grads = peer.grads_back(p_grads) if peer.grads_back else p_grads
        except Exception as exc:  # a peer that cannot run here: said, not fatal
            rows.append(dict(row, status=f"skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"))
            continue
        # a peer that rounds its output to bf16 where we run fp32 is held to bf16's precision, in its gradients too
        # (they come back through its rounded output)
        p_tol = max(tol, BF16_TOL) if peer.rounds_to_bf16 else tol
        problem = first_difference(p_out, p_grads, out, grads, p_tol, case.near_zero)
        if problem:
            rows.append(dict(row, status=f"differs: {problem}"))
            continue
        _, _, p_fwd, p_bwd = forward_backward(peer.run, peer_inputs, device, repeats)
        note = f" ({peer.note})" if peer.note else ""
        rows.append(dict(row, **timing_fields(p_fwd, p_bwd), status="equal" + note))
    return [_of_case(r, case) for r in rows]


def compile_floor(case: Case, device, repeats: int) -> dict:
    """The row of torch.compile of the case's eager math (the floor a fused kernel should beat)."""
    import torch

    _, _, fwd, bwd = forward_backward(torch.compile(reference(case.op)), case.make(), device, repeats)
    return _of_case(dict(impl="torch.compile(eager)", **timing_fields(fwd, bwd), status="ok"), case)


def _of_case(row: dict, case: Case) -> dict:
    return dict(row, op=case.op, shape=case.shape, what=case.what, fwd_bytes=case.fwd_bytes,
                bwd_bytes=case.bwd_bytes)


TUNE_MARGIN = 0.03  # a candidate replaces the shipped setting only when it is this much faster (timing noise)
TUNE_ROUNDS = 3  # timings of each candidate, in turn with the others, a different one first each round


def tune(case: Case, device, repeats: int, tol: float) -> List[dict]:
    """Each kernel our op launches, at each candidate setting (mega_depth/kernels/tuning.py: the launcher's warps
    and resident warps and their neighbours, and the table's entry where one replaced the guess), timed in the
    phase that launches it (forward, or backward from a fixed forward) with the others as shipped. Every
    candidate's output (forward) or gradients (backward) must equal the shipped setting's: the warps change a
    reduction's order, not its result. All candidates are compiled and checked first, then timed in TUNE_ROUNDS
    rounds, each candidate once a round and a different one first (the median counts): the H200's tuner of
    2026-11-30 timed each candidate once, the guess first and straight after the compiles, and its guesses came out
    slower in 30 of 35 rows. One row per kernel: the guess, the shipped setting where a table entry replaced it, the
    fastest candidate and its time; on a CPU (toy) nothing is timed and no winner is named."""
    import torch

    from mega_depth.kernels import tuning

    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in case.make()]
    wanted = [t for t in leaves if t.requires_grad]
    with tuning.observing() as fwd_seen:
        out = outputs(case.run(*leaves))
    go = output_gradient(out)
    with tuning.observing() as bwd_seen:
        ref_grads = torch.autograd.grad(out, wanted, go, retain_graph=True)
    def forward():  # without autograd (the same kernels): a forward with it would join the sources' gradient
        # sinks as one more reader each, and a source that enough mixes read has its gradient summed otherwise
        # (grad_sink.Sink.defer): the backward phase would time other kernels than it observed
        with torch.no_grad():
            return case.run(*leaves)

    phases = {"fwd": (forward, outputs, [o.detach() for o in out]),
              "bwd": (lambda: torch.autograd.grad(out, wanted, go, retain_graph=True), list, list(ref_grads))}
    rows = []
    for phase, seen in (("fwd", fwd_seen), ("bwd", bwd_seen)):
        run, results, expected = phases[phase]
        for key, shipped in dict(seen).items():  # one row per specialisation
            guess = tuning.guessed(key) or shipped
            row = dict(op=case.op, shape=case.shape, phase=phase, kernel=key, guess=list(guess), tried={})
            trying = tuning.candidates(guess)
            if shipped != guess:  # a table entry replaced the guess: it is timed too, and is what a winner must beat
                row["shipped"] = list(shipped)
                if shipped not in trying:
                    trying.append(shipped)
            valid = []
            for candidate in trying:  # compiled and checked, untimed
                tuning.clear_spilled()
                with tuning.forcing({key: candidate}), tuning.observing() as launched:
                    try:
                        got = results(run())
                    except Exception as exc:  # e.g. out of shared memory at more warps: not a candidate here
                        why = str(exc).splitlines()[0][:100] if str(exc) else ""
                        row["tried"][f"{candidate}"] = f"failed: {type(exc).__name__}: {why}"
                        continue
                if (key, candidate) not in launched:
                    raise SystemExit(f"{key}: the forced setting {candidate} did not reach the launch")
                if tuning.spilled().get(key):  # the shipped kernels never spill (tests/unit/test_kernels_aot.py)
                    row["tried"][f"{candidate}"] = f"spills {tuning.spilled()[key]} B"
                    continue
                problem = next((p for p in (agree(g, e, tol) for g, e in zip(got, expected)) if p), None)
                if problem:
                    raise SystemExit(f"{key} at {candidate}: differs from its shipped setting ({problem})")
                row["tried"][f"{candidate}"] = None
                valid.append(candidate)
            rounds: Dict[Tuple[int, int], List[float]] = {c: [] for c in valid}
            for r in range(TUNE_ROUNDS if valid else 0):
                for candidate in valid[r % len(valid):] + valid[:r % len(valid)]:
                    with tuning.forcing({key: candidate}):
                        timing = timed(run, device, repeats, series=False)
                    if timing is not None:
                        rounds[candidate].append(timing.seconds)
                if not any(rounds.values()):  # a CPU times nothing: one round runs each candidate once
                    break
            timings = {c: sorted(t)[len(t) // 2] for c, t in rounds.items() if t}  # candidate -> seconds (a GPU's)
            for candidate, seconds in timings.items():
                row["tried"][f"{candidate}"] = seconds
            if timings:
                row["rounds"] = {f"{c}": t for c, t in rounds.items()}
            if shipped in timings:
                best = min(timings, key=timings.get)
                if timings[best] < (1 - TUNE_MARGIN) * timings[shipped]:
                    row.update(best=list(best), best_s=timings[best], shipped_s=timings[shipped])
            rows.append(row)
    return rows


def host_seconds(case: Case, repeats: int) -> Tuple[float, float]:
    """The host's time (median of `repeats`) to issue our op's forward and its backward, on the CPU: Python,
    autograd, the dispatcher and the launchers, with the Triton launches recorded instead of run
    (kernels/common.recording). A GPU adds the driver's few microseconds a launch. Where this is close to an op's
    time on the GPU, the host, not the kernel, sets the pace."""
    import torch

    from mega_depth.kernels import common

    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in case.make()]
    wanted = [t for t in leaves if t.requires_grad]
    def median(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return sorted(times)[len(times) // 2]

    with common.recording(132):
        # the forward's calls first, each graph dropped with its output: a graph kept alive keeps its sources'
        # gradient sinks, and each later forward would join them as one more reader (the backward could then sum a
        # source's gradient at once, grad_sink.Sink.defer, where the op alone does not)
        fwd = median(lambda: case.run(*leaves))
        out = outputs(case.run(*leaves))
        go = [torch.ones_like(o) for o in out]
        bwd = median(lambda: torch.autograd.grad(out, wanted, go, retain_graph=True))
    return fwd, bwd


def bandwidth_references(device, dtype, row_bytes: int, repeats: int) -> Dict[str, Optional[float]]:
    """GB/s of a copy and of an 8-source sum (bytes: 2 x 8 rows and 9 rows) of rows of row_bytes."""
    import torch

    n = max(1, row_bytes // torch.tensor([], dtype=dtype).element_size())
    src = torch.randn(8 * n, device=device).to(dtype)
    dst = torch.empty_like(src)
    out = torch.empty(n, device=device, dtype=dtype)
    copy = timed(lambda: dst.copy_(src), device, repeats)
    add = timed(lambda: torch.sum(src.view(8, n), dim=0, out=out), device, repeats)
    return {"copy_GBps": None if copy is None else 2 * 8 * row_bytes / copy.seconds / 1e9,
            "sum8_GBps": None if add is None else 9 * row_bytes / add.seconds / 1e9, **launch_references(device)}


def launch_references(device) -> Dict[str, Optional[float]]:
    """The host's microseconds to issue one tiny launch, three ways: an aten add; Triton's launcher alone
    (kernel[grid](...) of common._sum_rows_kernel); the same kernel through common.sum_rows (our Python, the
    tuned-setting lookup, then the launcher). What a mixing call's host time is made of, on this host (None off a
    GPU: the development VM records launches instead of running them)."""
    import torch

    from mega_depth.kernels import common

    parts = torch.ones(2, 16, device=device)
    out = torch.empty(16, device=device)
    br, bk = common._sum_rows_blocks(2, 16)
    warps = max(1, br * bk // 1024)

    def triton_alone():
        common._sum_rows_kernel[(common.cdiv(16, bk),)](parts, out, out, out, parts, parts, 2, 16, 16, 16, BR=br,
                                                         BK=bk, SCALES=0, **common.options(warps))

    found = {"torch_add": timed(lambda: torch.add(parts, parts, out=parts), device, 20), "triton_launch": None,
             "sum_rows": None}
    if common.uses_triton(parts):
        found["triton_launch"] = timed(triton_alone, device, 20)
        found["sum_rows"] = timed(lambda: common.sum_rows(parts), device, 20)
    return {f"{name}_host_us": None if t is None else 1e6 * t.host_seconds for name, t in found.items()}


def with_rates(rows: List[dict], copy_gbps: Optional[float]) -> List[dict]:
    for r in rows:
        for phase in ("fwd", "bwd"):
            t = r[f"{phase}_s"]
            gbps = None if t is None else r[f"{phase}_bytes"] / t / 1e9
            r[f"{phase}_GBps"] = gbps
            r[f"{phase}_pct_copy"] = None if gbps is None or not copy_gbps else 100 * gbps / copy_gbps
    return rows


def _table_order(row: dict):
    """Each op's rows together: ours, the peers, then the torch.compile floor."""
    impl = {"mega_depth": 0, "torch.compile(eager)": 2}.get(row["impl"], 1)
    return row["shape"], OPS.index(row["op"]), impl


def markdown(rows: List[dict]) -> str:
    """The table; "ms" is a call's device time (a CUDA graph of the calls, replayed), "host ms" the host's time to
    issue a call eagerly."""
    lines = ["| op | shape | implementation | fwd ms | fwd GB/s (% copy) | fwd host ms | bwd ms | bwd GB/s (% copy) "
             "| bwd host ms | status |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]

    def cells(r, phase):
        if r[f"{phase}_s"] is None:
            return ["", "", ""]
        host = r.get(f"{phase}_host_s")
        return [f"{r[f'{phase}_s'] * 1e3:.3f}", f"{r[f'{phase}_GBps']:.0f} ({r[f'{phase}_pct_copy']:.0f} %)",
                "" if host is None else f"{host * 1e3:.3f}"]
    for r in rows:
        eager = [p for p in ("fwd", "bwd") if r.get(f"{p}_graphed") not in (None, "yes")]
        status = r["status"] + (f"; {' and '.join(eager)} timed as an eager series (not captured)" if eager else "")
        lines.append("| " + " | ".join([r["op"], r["shape"], r["impl"], *cells(r, "fwd"), *cells(r, "bwd"),
                                        status]) + " |")
    return "\n".join(lines)


def breakdown_markdown(rows: List[dict]) -> str:
    """Our rows' kernels (--kernel-breakdown): per op and phase, each kernel's device us and launches."""
    lines = ["| op | shape | phase | kernels (a CPU's dry run: operators): us (launches), longest first |",
             "|---|---|---|---|"]
    for r in rows:
        for phase in ("fwd", "bwd"):
            kernels = r.get(f"{phase}_kernels")
            if kernels:
                lines.append(f"| {r['op']} | {r['shape']} | {phase} | "
                             + ", ".join(f"`{name}` {us:.1f} ({n})" for name, us, n in kernels) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--shapes", default="1b,7b", help="config sizes whose step sizes to run")
    parser.add_argument("--ops", default=",".join(OPS), help=f"ops, comma-separated ({', '.join(OPS)})")
    parser.add_argument("--repeats", type=int, default=5,
                        help="calls in each of the timed series per implementation and phase")
    parser.add_argument("--toy", action="store_true", help="toy sizes in fp32 on the CPU: run and check, no timing")
    parser.add_argument("--no-compile-floor", action="store_true", help="skip torch.compile of the eager math")
    parser.add_argument("--host-profile", action="store_true",
                        help="with each timing, where the host's time to issue a call went (cProfile: the top "
                        "functions by own time), in the JSON rows as fwd_host_profile / bwd_host_profile")
    parser.add_argument("--kernel-breakdown", action="store_true",
                        help="with our rows, each phase's kernels and their device times (one call under "
                        "torch.profiler), in the JSON rows as fwd_kernels / bwd_kernels and after the table")
    parser.add_argument("--passes", default=",".join(PASSES),
                        help=f"which rows, comma-separated ({', '.join(PASSES)}): our kernels, the published "
                        "peers, torch.compile of the eager math (a device check runs ours first, the peers later: "
                        "their first compiles and autotuning take minutes)")
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table")
    parser.add_argument("--host", action="store_true",
                        help="instead of the table: the host's time to issue each op's forward and backward, on "
                             "the CPU with the launches recorded (no GPU needed)")
    parser.add_argument("--tune", default=None, metavar="TABLE",
                        help="instead of the table: time each kernel's warps and resident warps around the "
                             "launcher's guess and write the winners for this GPU into TABLE (merged; the shipped "
                             "one is mega_depth/kernels/tuned.json)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.ops.split(",")) - set(OPS))
    if unknown:
        parser.error(f"unknown --ops {unknown}; choose from {', '.join(OPS)}")
    unknown = sorted(set(args.passes.split(",")) - set(PASSES))
    if unknown:
        parser.error(f"unknown --passes {unknown}; choose from {', '.join(PASSES)}")
    import torch

    from mega_depth.quiet import quiet_known_warnings

    quiet_known_warnings()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mega_depth.kernels import common

    if args.host:
        return _host_all(args)
    global HOST_PROFILE, KERNEL_BREAKDOWN
    HOST_PROFILE, KERNEL_BREAKDOWN = args.host_profile, args.kernel_breakdown
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not args.toy \
        else torch.device("cpu")
    if device.type != "cuda" and not args.toy:
        parser.error("no GPU: pass --toy (toy sizes on the CPU under TRITON_INTERPRET=1, checks only)")
    if args.toy and not (common.interpreting() and common.FORCE_TRITON):
        parser.error("--toy runs the Triton kernels under the interpreter: set TRITON_INTERPRET=1 "
                     "MEGA_DEPTH_KERNELS_FORCE_TRITON=1 (without them the CPU runs the torch twins)")
    # On a GPU everything runs on a side stream: timed() captures calls as CUDA graphs on the current stream, which
    # the legacy default stream cannot be, and a backward is captured on the stream its forward ran on
    with torch.cuda.stream(torch.cuda.Stream()) if device.type == "cuda" else contextlib.nullcontext():
        dtype = torch.float32 if args.toy else torch.bfloat16
        tol = 1e-4 if args.toy else BF16_TOL
        start, rows, refs = time.time(), [], {}
        device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (toy, untimed)"
        def save():  # after every case: a run cut short by its time box keeps what it finished
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"device": device_name, "references": refs, "rows": rows, "seconds": time.time() - start},
                              f, indent=1)

        if args.tune:
            return _tune_all(args, dtype, device, tol, device_name, start)
        chosen = {}
        for shape in (["toy"] if args.toy else args.shapes.split(",")):
            chosen[shape] = [c for c in cases(shape, dtype, device, args.toy) if c.op in args.ops.split(",")]
            found_sizes = sizes(shape, args.toy)
            refs[shape] = bandwidth_references(device, dtype, found_sizes["tokens"] * found_sizes["d"] * dtype.itemsize,
                                               args.repeats)
            print(f"{shape} references: " + ", ".join(f"{k} {v:.1f}" for k, v in refs[shape].items() if v is not None),
                  flush=True)
        # three passes, each over every op: ours, the peers, then the torch.compile floor (compiling every op's eager
        # math takes longest), so that a run cut short by its time box has every op's own row first
        passes = [("ours", lambda c: [measure_ours(c, device, args.repeats, tol)]),
                  ("peers", lambda c: measure_peers(c, device, args.repeats, tol))]
        if not args.no_compile_floor and not args.toy:
            passes.append(("torch.compile", lambda c: [compile_floor(c, device, args.repeats)]))
        passes = [(label, run) for label, run in passes if label in args.passes.split(",")]
        for label, run_pass in passes:
            for shape, shape_cases in chosen.items():
                for case in shape_cases:
                    began = time.time()
                    with case.within():
                        found = run_pass(case)
                    rows += with_rates(found, refs[shape]["copy_GBps"])
                    print(f"{shape} {case.op} ({label}, {time.time() - began:.1f} s): "
                          + "; ".join(f"{r['impl']} {r['status']}" for r in found), flush=True)
                    for r in found:  # --host-profile: the top of each profile, the rest in the JSON
                        for phase in ("fwd", "bwd"):
                            for name, calls, us in r.get(f"{phase}_host_profile", [])[:5]:
                                print(f"    {r['impl']} {phase} host: {us:7.1f} us in {name} ({calls:g} a call)")
                    save()
        if args.markdown:
            print(markdown(sorted(rows, key=_table_order)))
            if args.kernel_breakdown:
                print(breakdown_markdown(sorted(rows, key=_table_order)))
        print(f"{len(rows)} rows in {time.time() - start:.0f} s")
        wrong = [f"{r['op']} {r['shape']}" for r in rows
                 if r["impl"] == "mega_depth" and r["status"].startswith("differs")]
        if wrong:
            print(f"our kernels differ from the eager math in: {', '.join(wrong)}", file=sys.stderr)
        return 1 if wrong else 0


def _host_all(args) -> int:
    """--host: host_seconds of every chosen op at every chosen shape, as a table (and JSON with --out)."""
    import torch

    rows = []
    print("| op | shape | fwd host us | bwd host us |\n|---|---|---:|---:|")
    for shape in args.shapes.split(","):
        for case in cases(shape, torch.bfloat16, torch.device("cpu"), toy=False, host_only=True):
            if case.op not in args.ops.split(","):
                continue
            with case.within():
                fwd, bwd = host_seconds(case, max(args.repeats, 5))
            rows.append(dict(op=case.op, shape=shape, fwd_host_s=fwd, bwd_host_s=bwd))
            print(f"| {case.op} | {shape} | {fwd * 1e6:.0f} | {bwd * 1e6:.0f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": "cpu (host time, launches recorded)", "rows": rows}, f, indent=1)
    return 0


def _tune_all(args, dtype, device, tol, device_name, start) -> int:
    """--tune: every op's kernels at every shape; the winners merged into args.tune under this GPU's target, and
    every row (the tried settings and their times) beside it as <TABLE>.rows.json."""
    import torch

    from mega_depth.kernels import tuning

    rows = []
    for shape in (["toy"] if args.toy else args.shapes.split(",")):
        for case in (c for c in cases(shape, dtype, device, args.toy) if c.op in args.ops.split(",")):
            with case.within():
                found = tune(case, device, args.repeats, tol)
            rows += found
            better = [r for r in found if "best" in r]
            print(f"{shape} {case.op}: {len(found)} kernels, {len(better)} faster than the shipped setting"
                  + "".join(f"; {r['kernel'].split('(')[0]} {tuple(r.get('shipped', r['guess']))} -> "
                            f"{tuple(r['best'])} {r['shipped_s'] / r['best_s']:.2f}x" for r in better), flush=True)
            with open(args.tune + ".rows.json", "w") as f:
                json.dump({"device": device_name, "rows": rows, "seconds": time.time() - start}, f, indent=1)
            # a winner that is the launcher's own guess needs no entry: a table entry it beat is removed
            winners = {r["kernel"]: None if r["best"] == r["guess"] else tuple(r["best"]) for r in found
                       if "best" in r}
            if winners:  # after every op: a run cut short by its time box keeps what it found
                target = tuning.target(torch.cuda.get_device_capability())
                table = tuning.merged(args.tune, target, winners)
                with open(args.tune, "w") as f:
                    json.dump(table, f, indent=1)
                    f.write("\n")
                # the ops after this one launch what was written (a kernel several ops launch, phase 2's or
                # sum_rows', is then tuned against its new setting, not the one this run started with)
                tuning.TABLE = {**tuning.TABLE, target: tuning.with_winners(tuning.TABLE.get(target, {}), winners)}
    print(f"{len(rows)} kernels tuned in {time.time() - start:.0f} s; "
          f"{sum('best' in r for r in rows)} settings written to {args.tune}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
