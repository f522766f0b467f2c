"""Attention Residuals (arXiv 2603.15031) with the paper's ablation switches (§5.3); the math: docs/mechanisms.md §4.

Each sublayer reads a softmax mix of earlier outputs (Full: every sublayer output; Block: block sums plus the
running partial sum of the current block); one more mix feeds the final norm. Switches: an input-dependent query,
sigmoid weights, multi-head depth weights, no key norm, input-independent scalar mixing. With the static query (the
default) Block AttnRes runs the exact two-phase computation, in training as at inference: all queries of a block
meet the completed blocks in one pass (phase 1), then each sublayer merges the partial sum by an online-softmax
update (phase 2). The input-dependent query depends on the running state, so
it (and scalar mixing, which has no query) mixes sublayer by sublayer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Entry, Mechanism, Option, Recomputed, sublayer_label, summed_gradients, sunk_gradients
from .mixing import (attnres_block_phase2, attnres_logits, attnres_mix_sources, attnres_phase1_sources,
                     depth_weights, rms_inverse, scalar_mix)


@dataclass(frozen=True)
class AttnResLayout:
    """Which AttnRes block each sublayer belongs to. num_blocks == num_sublayers is Full AttnRes.

    Blocks are numbered 1..N (block 0 is the embedding). Blocks 1..N-1 hold S = L // N sublayers; the remainder
    goes to the last block (docs/mechanisms.md §4).
    """

    num_sublayers: int
    num_blocks: int

    def __post_init__(self):
        if not 1 <= self.num_blocks <= self.num_sublayers:
            raise ValueError(f"AttnRes needs 1 <= num_blocks <= num_sublayers ({self.num_sublayers}), got "
                             f"{self.num_blocks}; use --attnres-num-blocks between 1 and 2 * --num-layers, or omit "
                             "it for Full AttnRes")

    @property
    def block_size(self) -> int:
        return self.num_sublayers // self.num_blocks

    def block_of(self, sublayer: int) -> int:
        """Block (1..N) of sublayer (1..L)."""
        return min((sublayer - 1) // self.block_size, self.num_blocks - 1) + 1

    def block_start(self, block: int) -> int:
        return (block - 1) * self.block_size + 1

    def block_end(self, block: int) -> int:
        return self.num_sublayers if block == self.num_blocks else block * self.block_size

    def completed_blocks_before(self, sublayer: int) -> int:
        """Number of completed blocks (b_1..) before sublayer runs; sublayer L+1 means 'after the last'."""
        if sublayer > self.num_sublayers:
            return self.num_blocks
        return self.block_of(sublayer) - 1

    def has_partial_before(self, sublayer: int) -> bool:
        """Whether a partial sum of the current block exists when sublayer runs."""
        if sublayer > self.num_sublayers:
            return False
        return sublayer != self.block_start(self.block_of(sublayer))

    def num_sources_before(self, sublayer: int) -> int:
        """Sources of sublayer: b_0 .. b_{n-1} (+ partial). With sublayer = L+1: the final aggregation's."""
        return 1 + self.completed_blocks_before(sublayer) + int(self.has_partial_before(sublayer))


class AttnResState:
    """Completed block sums (`blocks[0]` is the embedding b_0) and the running partial sum of the current block.

    `next_sublayer` is the 1-based sublayer that runs next. `phase1` caches the two-phase block's phase-1 results
    for the sublayers still to come on this stage; it never leaves the stage (a later stage recomputes it).
    `block_queries` holds, per block, the stacked queries of its sublayers in the layers that run next (AttnRes.
    prepare), which phase 1 meets with the completed blocks at once."""

    def __init__(self, layout: AttnResLayout, blocks: List[Tensor], partial: Optional[Tensor], next_sublayer: int):
        self.layout = layout
        self.blocks = list(blocks)
        self.partial = partial
        self.next_sublayer = next_sublayer
        self.phase1: Dict[int, tuple] = {}  # sublayer -> (m, z, o)
        self.block_queries: Dict[int, tuple] = {}  # block -> (sublayers, queries [S, d], gains [S, d] or None)

    def source_list(self) -> List[Tensor]:
        """The sources of the next sublayer (or of the final aggregation once all ran), in order."""
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def sources(self) -> Tensor:
        """[K, *, d]: the same, stacked."""
        return torch.stack(self.source_list())

    def newest(self) -> Tensor:
        """The newest source: the partial sum, or the last completed block (input-dependent query)."""
        return self.partial if self.partial is not None else self.blocks[-1]

    def record(self, output: Tensor) -> None:
        """Add the output f of sublayer `next_sublayer` and close its block when it is the block's last."""
        self.partial = output if self.partial is None else self.partial + output
        block = self.layout.block_of(self.next_sublayer)
        if self.next_sublayer == self.layout.block_end(block):
            self.blocks.append(self.partial)
            self.partial = None
        self.phase1.pop(self.next_sublayer, None)
        self.next_sublayer += 1


class AttnResMixer(nn.Module):
    """One AttnRes aggregation. Static query: pseudo-query w (init ZERO, so training starts from the uniform
    average) and the key RMSNorm gain (init one). Input-dependent query: a d x d projection (init ZERO) in place
    of w. Scalar mixing: one learned logit per source (init zero) and nothing else."""

    def __init__(self, hidden_size: int, num_sources: int, query: str, mixing: str, key_norm: bool,
                 dtype: Optional[torch.dtype] = None, query_norm: bool = False):
        super().__init__()
        if mixing == "scalar":
            self.logits = nn.Parameter(torch.zeros(num_sources, dtype=dtype))
            return
        shape = (hidden_size,) if query == "static" else (hidden_size, hidden_size)
        self.query = nn.Parameter(torch.zeros(shape, dtype=dtype))
        self.key_norm_weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype)) if key_norm else None
        # --attnres-query-norm: the gain of the RMSNorm on the projected query (init one)
        self.query_norm_weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype)) if query_norm else None


class AttnRes(Mechanism):
    name = "attnres"
    options = (
        Option("attnres_num_blocks", int, None, "AttnRes blocks N (omit for Full AttnRes: one block per sublayer)"),
        Option("attnres_query", str, "static", "static: a learned pseudo-query per sublayer (two-phase block "
               "computation in training and inference); input: projected from the newest source "
               "(mixes sublayer by sublayer)", ("static", "input")),
        Option("attnres_weight", str, "softmax", "depth weights: softmax over sources, or an independent "
               "sigmoid per source", ("softmax", "sigmoid")),
        Option("attnres_heads", int, 1, "multi-head depth weights: one weight per source and per group of "
               "hidden/H channels"),
        Option("attnres_key_norm", bool, True, "RMSNorm on the keys (--no-attnres-key-norm drops it)"),
        Option("attnres_mixing", str, "query", "query: attention over sources; scalar: input-independent "
               "learned logits per source", ("query", "scalar")),
        # The input-dependent query's readings (the paper gives one line: "projecting it from the current hidden
        # state"; none of these is the authors' code). docs/mechanisms.md §4.
        Option("attnres_query_source", str, "newest", "input-dependent query: projected from the newest source, or "
               "from the sum of all sources (what a standard residual stream would hold)", ("newest", "sum")),
        Option("attnres_query_scale", str, "inv_d", "input-dependent query: a fixed multiplier on the projection "
               "(inv_d: 1/d, the default since it trained best; rsqrt_d: 1/sqrt(d), a softmax temperature; one: "
               "none, the default before). From the zero init, under Adam this is also the projection's "
               "learning-rate scale, as muP sets it for a d x d map", ("inv_d", "rsqrt_d", "one"),
               unrecorded="one"),
        Option("attnres_query_norm", bool, False, "input-dependent query: an RMSNorm (gain init one) on the "
               "projected query"),
    )
    module_names = ("attn_mixer", "mlp_mixer", "final_mixer")

    def __init__(self, residual, shape, tp=1, sp=False):
        super().__init__(residual, shape, tp, sp)
        r = residual
        self.attnres_layout = AttnResLayout(shape.num_sublayers, r.attnres_num_blocks or shape.num_sublayers)
        self.query_kind, self.weight, self.heads = r.attnres_query, r.attnres_weight, r.attnres_heads
        self.key_norm, self.mixing = r.attnres_key_norm, r.attnres_mixing
        self.query_source, self.query_norm = r.attnres_query_source, r.attnres_query_norm
        self.query_scale = {"one": 1.0, "rsqrt_d": shape.hidden_size ** -0.5,
                            "inv_d": 1.0 / shape.hidden_size}[r.attnres_query_scale]
        self.eps = shape.norm_epsilon
        # The two-phase form needs queries that do not depend on the state, and blocks of several sublayers.
        self.two_phase = (self.mixing == "query" and self.query_kind == "static"
                          and self.attnres_layout.block_size > 1)

    def inference_form(self):
        if self.two_phase:
            return ("exact two-phase block computation: each block's queries meet the completed blocks at once, "
                    "then an online-softmax merge of the partial sum per sublayer")
        reason = "input-dependent query" if self.query_kind == "input" else \
            "scalar mixing" if self.mixing == "scalar" else "one sublayer per block (Full AttnRes)"
        return f"sublayer by sublayer ({reason}); the KV cache has the standard layout"

    @classmethod
    def catalogue(cls, num_layers):
        return {
            "attnres-full": {"mechanism": "attnres"},
            # Block AttnRes with the paper's 8 blocks (at most one per layer)
            "attnres-block": {"mechanism": "attnres", "attnres_num_blocks": min(8, num_layers)},
            # the best ablation of §5.3 (Full AttnRes with an input-dependent query)
            "attnres-input-query": {"mechanism": "attnres", "attnres_query": "input"},
        }

    @classmethod
    def validate(cls, cfg, fail):
        r, L = cfg.residual, 2 * cfg.model.num_layers
        if r.attnres_num_blocks is not None:
            fail(1 <= r.attnres_num_blocks <= L, f"--attnres-num-blocks {r.attnres_num_blocks} must lie in 1..{L} "
                 f"(2 sublayers per layer x {cfg.model.num_layers} layers); omit it for Full AttnRes")
        fail(r.attnres_heads >= 1 and cfg.model.hidden_size % r.attnres_heads == 0,
             f"--attnres-heads {r.attnres_heads} must divide --hidden-size {cfg.model.hidden_size}")
        fail(not (r.attnres_mixing == "scalar" and r.attnres_heads > 1),
             "--attnres-mixing scalar has no query to split into heads; drop --attnres-heads")
        fail(not (r.attnres_mixing == "scalar" and r.attnres_query == "input"),
             "--attnres-mixing scalar has no query; drop --attnres-query input")
        fail(not (r.attnres_mixing == "scalar" and r.attnres_weight == "sigmoid"),
             "--attnres-mixing scalar is a softmax over learned logits; drop --attnres-weight sigmoid")
        defaults = {o.name: o.default for o in cls.options}
        readings = ["--" + name.replace("_", "-") for name in ("attnres_query_source", "attnres_query_scale",
                                                   "attnres_query_norm") if getattr(r, name) != defaults[name]]
        fail(r.attnres_query == "input" or not readings,
             f"{', '.join(readings)} only apply to the input-dependent query; add --attnres-query input or drop "
             "them")

    # --- parameters ---------------------------------------------------------------------------------------------
    def _mixer(self, sublayer: int, dtype) -> AttnResMixer:
        return AttnResMixer(self.shape.hidden_size, self.attnres_layout.num_sources_before(sublayer),
                            self.query_kind, self.mixing, self.key_norm, dtype,
                            query_norm=self.query_kind == "input" and self.query_norm)

    def layer_modules(self, layer, dtype=None):
        return {"attn_mixer": self._mixer(2 * layer + 1, dtype), "mlp_mixer": self._mixer(2 * layer + 2, dtype)}

    def final_modules(self, dtype=None):
        return {"final_mixer": self._mixer(self.shape.num_sublayers + 1, dtype)}

    @property
    def homogeneous_layers(self):
        return self.mixing != "scalar"  # scalar logits grow with depth

    # --- forward ------------------------------------------------------------------------------------------------
    def initial_state(self, embedding):
        return AttnResState(self.attnres_layout, [embedding], None, 1)

    def _gain(self, mixer: AttnResMixer) -> Optional[Tensor]:
        return mixer.key_norm_weight if self.key_norm else None

    def _query(self, mixer: AttnResMixer, state: AttnResState) -> Tensor:
        """The static pseudo-query [d], or the input-dependent one [*, d]:
        q = c * [RMSNorm_q](W^Q RMSNorm_l(s)), s the newest source (or the sum of all sources), c the scale."""
        if self.query_kind == "static":
            return mixer.query
        s = state.newest() if self.query_source == "newest" else torch.stack(state.source_list()).sum(0)
        if self.key_norm:  # the mixer's own key norm, gain included
            s = (s.float() * rms_inverse(s, self.eps).unsqueeze(-1)).to(s.dtype) * mixer.key_norm_weight
        q = F.linear(s, mixer.query)
        if self.query_norm:
            q = (q.float() * rms_inverse(q, self.eps).unsqueeze(-1)).to(q.dtype) * mixer.query_norm_weight
        return q * self.query_scale if self.query_scale != 1.0 else q

    def mix(self, mixer: AttnResMixer, state: AttnResState, sublayer: int) -> Tensor:
        """The input h of `sublayer` (or of the final norm, sublayer L+1) from the state's sources."""
        if self.recorder is not None:
            self.recorder.add("attnres", *sublayer_label(sublayer, self.shape.num_sublayers),
                              self.weights(mixer, state), softmax=self.weight == "softmax" and self.mixing == "query")
        if sublayer in state.phase1:
            m, z, o = state.phase1[sublayer]
            return self.kernel("attnres_phase2", attnres_block_phase2)(
                m, z, o, state.partial, mixer.query, self._gain(mixer), self.eps, self.weight, self.heads)
        if self.mixing == "scalar":
            return scalar_mix(state.sources(), mixer.logits)
        return self.kernel("attnres_mix_sources", attnres_mix_sources)(
            state.source_list(), self._query(mixer, state), self._gain(mixer), self.eps, self.weight, self.heads)

    def _sublayer_input(self, mixer: AttnResMixer, state: AttnResState, sublayer: int):
        """`mix`, or on the fast path of the two-phase form a `Recomputed` phase-2 merge: the sublayer's input is
        then rebuilt in backward from (m, z, o, partial), which phase 2 keeps anyway, instead of being kept too."""
        if not (self.recomputes and sublayer in state.phase1):
            return self.mix(mixer, state, sublayer)
        phase2 = self.kernel("attnres_phase2", attnres_block_phase2)
        query, gain = mixer.query, self._gain(mixer)

        def merge(m, z, o, partial):
            return phase2(m, z, o, partial, query, gain, self.eps, self.weight, self.heads)

        def normalised(norm_weight, norm_eps, m, z, o, partial):  # the merge and the host's norm, one kernel
            return self.kernels.attnres_phase2_normed(norm_weight, norm_eps, m, z, o, partial, query, gain, self.eps,
                                                      self.weight, self.heads)

        # no reader of these sums gradients: the plain checkpoint
        return Recomputed(merge, (*state.phase1[sublayer], state.partial), remakes=self.fused,
                          normalised=normalised if self.fused else None)

    def weights(self, mixer: AttnResMixer, state: AttnResState) -> Tensor:
        """The depth weights alpha [K, *] of one mix (heatmaps)."""
        sources = state.sources()
        if self.mixing == "scalar":
            return torch.softmax(mixer.logits.float(), 0)
        logits = attnres_logits(sources, self._query(mixer, state), self._gain(mixer), self.eps, self.heads)
        return depth_weights(logits, self.weight)

    def prepare(self, layers, state):
        """Two-phase: per block, the sublayers it has in `layers` and their stacked queries (and key-norm gains)."""
        if not self.two_phase:
            return
        members: Dict[int, list] = {}
        for layer in layers:
            for sub, name in ((2 * layer.layer_index + 1, "attn_mixer"), (2 * layer.layer_index + 2, "mlp_mixer")):
                members.setdefault(self.attnres_layout.block_of(sub), []).append((sub, getattr(layer, name)))
        state.block_queries = {
            block: ([s for s, _ in subs], torch.stack([m.query for _, m in subs]),
                    torch.stack([m.key_norm_weight for _, m in subs]) if self.key_norm else None)
            for block, subs in members.items()}

    def _phase1(self, state: AttnResState, layer) -> None:
        """Phase 1 for the sublayers of the current block that run next (those `prepare` gathered; this layer's
        alone where the host runs layers one by one without it)."""
        block = self.attnres_layout.block_of(state.next_sublayer)
        if block not in state.block_queries:
            self.prepare([layer], state)
        subs, queries, gains = state.block_queries[block]
        phase1 = self.kernel("attnres_phase1_sources", attnres_phase1_sources)
        m, z, o = phase1(state.blocks, queries, gains, self.eps, self.weight, self.heads)
        # unbind, not indexing: the backward of each index zero-fills the whole [S, N, d] buffer to write one
        # slice, and autograd adds S of them; unbind's backward stacks the S gradients once. On the fused path the
        # slices of o are the fast path's (grad_sink.unbound): each phase 2 writes its slice's gradient into one
        # buffer, which is o's gradient, with no stack
        unbind = self.kernel("unbound", lambda t: t.unbind(0))
        state.phase1 = dict(zip(subs, zip(m.unbind(0), z.unbind(0), unbind(o))))

    def layer_forward(self, layer, state):
        for name, run in (("attn_mixer", layer.attention_sublayer), ("mlp_mixer", layer.mlp_sublayer)):
            sub = state.next_sublayer
            if self.two_phase and sub not in state.phase1:
                self._phase1(state, layer)
            state.record(run(self._sublayer_input(getattr(layer, name), state, sub)))
        return state

    def final_hidden(self, state, decoder):
        return self.mix(decoder.final_mixer, state, self.shape.num_sublayers + 1)

    def io_units(self, fused=True):
        S, lay = self.shape.num_sublayers, self.attnres_layout
        if not self.two_phase:  # sublayer by sublayer: sublayer l reads its l sources, writes its input
            def query_reads(l):  # the input-dependent query reads the newest source, or all l of them
                return 0.0 if self.query_kind != "input" else float(l) if self.query_source == "sum" else 1.0
            return sum(l + 1 + query_reads(l) for l in range(1, S + 1)) + (S + 2)
        total = 0.0  # two-phase: per sublayer n/S (phase 1's read of the n completed blocks, shared) + 5
        for b in range(1, lay.num_blocks + 1):
            members = lay.block_end(b) - lay.block_start(b) + 1
            total += members * (b / members + 5)
        return total + (lay.num_blocks + 2)  # the output aggregation

    def kernel_io_units(self, recompute=True):
        """Sublayer by sublayer (Full AttnRes, the input-dependent query): each mix reads its K sources and writes
        its input; backward reads them again with the output gradient (and, with softmax weights, the output), and
        the sources' gradients are summed in the kernels (with static queries, a source that many mixes read by its
        sink, at once); a per-token query is read, and its gradient written in fp32. Two-phase (Block AttnRes): per
        block, phase 1 reads the n completed blocks and writes one output per member sublayer, its backward reads
        the blocks once more; per sublayer, phase 2 reads phase 1's output (and the partial sum) and writes the
        input, and its backward reads those and the input's gradient and writes theirs. With the recomputation
        (the default), where the host's norm is the fused one (a GPU's local spec), phase 2 writes the normalised
        input and its backward starts from that one's gradient (`attnres_phase2_normed`): nothing is made again.
        Without it, each phase 2 runs once and its input is kept. The final aggregation is a mix over the blocks.
        Scalar mixing runs no kernel."""
        S, lay = self.shape.num_sublayers, self.attnres_layout
        if self.mixing == "scalar":
            return 0.0
        per_token_query = self.query_kind == "input"
        mixes, total = [], 0.0
        if self.two_phase:
            for b in range(1, lay.num_blocks + 1):
                n, members = b, lay.block_end(b) - lay.block_start(b) + 1  # blocks b_0 .. b_{b-1}
                total += (n + members) + (2 * n + members) + n
                for sub in range(lay.block_start(b), lay.block_end(b) + 1):
                    p = int(lay.has_partial_before(sub))
                    total += (2 + p) + (3 + 2 * p)
            mixes.append([f"b{j}" for j in range(lay.num_blocks + 1)])
        else:
            for sub in range(1, S + 2):
                blocks = [f"b{j}" for j in range(lay.completed_blocks_before(sub) + 1)]
                mixes.append(blocks + ([f"partial{sub}"] if lay.has_partial_before(sub) else []))
        readers: Dict[str, int] = {}
        saved_output = int(self.weight == "softmax")  # the softmax gradient's go . h
        for sources in mixes:  # forward, backward (+ q, dq in fp32)
            total += 2 * (len(sources) + 1) + saved_output + (4 if per_token_query else 0)
            for s in sources:
                readers[s] = readers.get(s, 0) + 1
        if per_token_query:
            return total + sunk_gradients(readers)
        # static queries: a source that many mixes read has its gradient summed by its sink at once, each reader
        # leaving 2H + 1 fp32 coefficients a token for it (written and read: in [T, d] bf16 units)
        coefficients = 2 * (2 * self.heads + 1) * 4 / (2 * self.shape.hidden_size)
        return total + summed_gradients(readers, coefficients, reads_source=self.key_norm)

    # --- pipeline payload ---------------------------------------------------------------------------------------
    def layout(self, boundary):
        sublayer, lay, d = 2 * boundary + 1, self.attnres_layout, self.shape.hidden_size
        out = [Entry(f"block{n}", d, True) for n in range(1 + lay.completed_blocks_before(sublayer))]
        if lay.has_partial_before(sublayer):
            out.append(Entry("partial", d, False))
        return out

    def entries(self, state):
        out = {f"block{n}": b for n, b in enumerate(state.blocks)}
        if state.partial is not None:
            out["partial"] = state.partial
        return out

    def state_from(self, entries, boundary):
        n_blocks = 1 + self.attnres_layout.completed_blocks_before(2 * boundary + 1)
        blocks = [entries[f"block{n}"] for n in range(n_blocks)]
        return AttnResState(self.attnres_layout, blocks, entries.get("partial"), 2 * boundary + 1)
