"""The depth-mixing math of SPEC.md, in plain PyTorch.

This is the ONE place where AttnRes, DCA and Depth-Attention are computed. The Megatron-core layers, the
plain-PyTorch / Hugging Face model and the tests all call into it; nothing here knows about parallelism,
pipelines or Megatron. Every function works on tensors whose LAST dim is the feature dim, with any leading
layout ([s, b, d] in Megatron, [b, s, d] in Hugging Face).

Conventions
- "sources" / "stack" tensors are [K, *lead, d]: K depth entries stacked on a new leading dim.
- Softmaxes over depth run in fp32 and are cast back to the input dtype (SPEC.md).
- Sublayers are numbered 1..L (L = 2 * num_blocks: attention = 2t-1, MLP = 2t for transformer block t).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor, nn

# --------------------------------------------------------------------------------------------------------------
# Recording depth weights (what each layer reads from which source), for heatmaps. Off unless a recorder is active.
# --------------------------------------------------------------------------------------------------------------

_RECORDER: Optional[dict] = None


class record_depth_weights:
    """Context manager: while active, every mix stores its mean depth weights, {key: [K] tensor}. Keys are the
    mixer modules (AttnRes, GRN) or ("depth-attention", layer)."""

    def __enter__(self) -> dict:
        global _RECORDER
        _RECORDER = {}
        return _RECORDER

    def __exit__(self, *exc):
        global _RECORDER
        _RECORDER = None


def _record(key, weights: Tensor) -> None:
    """weights [K, *]: mean over everything but the source dim."""
    if _RECORDER is not None:
        _RECORDER[key] = weights.detach().float().flatten(1).mean(1).cpu()


# --------------------------------------------------------------------------------------------------------------
# AttnRes (arXiv 2603.15031)
# --------------------------------------------------------------------------------------------------------------


# torch.compile'd twins of the hot functions, switched on by `compile_kernels(True)` (--compile-mixing): on a GPU
# the eager mixing is many small memory-bound kernels, which the compiler fuses. The eager functions below stay
# the reference, and are what the heatmap recorder runs.
_COMPILED: dict = {}


def compile_kernels(enabled: bool) -> None:
    _COMPILED.clear()
    if enabled:
        # One compiled graph per distinct source count / None-pattern: a deep model needs more than dynamo's
        # default of 8 before it would fall back to eager (seen on an H200 with 24 sublayers).
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        for fn in (attnres_mix, grn_apply, depth_attention_mix):
            _COMPILED[fn.__name__] = torch.compile(fn, dynamic=True)


def kernel(fn: Callable) -> Callable:
    """`fn`, or its compiled twin when compile_kernels(True) is on and no recorder is listening."""
    return fn if _RECORDER is not None else _COMPILED.get(fn.__name__, fn)


def _fp32(x: Tensor) -> Tensor:
    """At least fp32 (bf16/fp16 are upcast; fp64 stays, for reference checks)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_inverse(x: Tensor, eps: float) -> Tensor:
    """1 / RMS(x) over the last dim, in fp32: [*, d] -> [*]."""
    return torch.rsqrt(_fp32(x).pow(2).mean(-1) + eps)


def attnres_logits(sources: Tensor, query: Tensor, key_norm_weight: Tensor, eps: float) -> Tensor:
    """w . RMSNorm(v_i) for every source, fp32: sources [K, *, d] -> [K, *].

    RMSNorm(v) . w = (v . (g * w)) / rms(v), so the gain folds into the query and the keys are never
    materialised normalised (one read of the sources instead of a normalised copy).
    """
    folded_query = (_fp32(key_norm_weight) * _fp32(query)).to(sources.dtype)
    return _fp32(sources @ folded_query) * rms_inverse(sources, eps)


def attnres_mix(sources: Tensor, query: Tensor, key_norm_weight: Tensor, eps: float) -> Tensor:
    """h = sum_i softmax_i(w . RMSNorm(v_i)) v_i: sources [K, *, d] -> [*, d]."""
    alpha = torch.softmax(attnres_logits(sources, query, key_norm_weight, eps), dim=0).to(sources.dtype)
    return torch.einsum("k...,k...d->...d", alpha, sources)


class AttnResMixer(nn.Module):
    """One AttnRes aggregation: a learned pseudo-query (init ZERO) and its key RMSNorm gain (init one)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.key_norm_weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, sources: Tensor) -> Tensor:
        if _RECORDER is not None:
            _record(self, self.weights(sources))
        return kernel(attnres_mix)(sources, self.query, self.key_norm_weight, self.eps)

    def weights(self, sources: Tensor) -> Tensor:
        """The depth weights alpha [K, *] (for logging / heatmaps)."""
        return torch.softmax(attnres_logits(sources, self.query, self.key_norm_weight, self.eps), dim=0)


@dataclass(frozen=True)
class AttnResLayout:
    """Which AttnRes block each sublayer belongs to. num_blocks == num_sublayers is Full AttnRes.

    Blocks are numbered 1..N (block 0 is the embedding). Blocks 1..N-1 hold S = L // N sublayers; the
    remainder goes to the last block (SPEC.md section 1).
    """

    num_sublayers: int
    num_blocks: int

    def __post_init__(self):
        if not 1 <= self.num_blocks <= self.num_sublayers:
            raise ValueError(
                f"AttnRes needs 1 <= num_blocks <= num_sublayers ({self.num_sublayers}), got {self.num_blocks}; "
                "use --attnres-num-blocks between 1 and 2 * --num-layers, or omit it for Full AttnRes."
            )

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
    """The cross-layer state of AttnRes (Full or Block): completed block sums and the running partial.

    `blocks[0]` is the embedding (b_0); `partial` is the sum of the outputs of the current block so far.
    `next_sublayer` is the 1-based index of the sublayer that runs next.
    """

    def __init__(self, layout: AttnResLayout, blocks: List[Tensor], partial: Optional[Tensor], next_sublayer: int):
        self.layout = layout
        self.blocks = list(blocks)
        self.partial = partial
        self.next_sublayer = next_sublayer

    @classmethod
    def from_embedding(cls, layout: AttnResLayout, embedding: Tensor) -> "AttnResState":
        return cls(layout, [embedding], None, 1)

    def sources(self) -> Tensor:
        """[K, *, d] sources of the next sublayer (or of the final aggregation once all ran)."""
        entries = self.blocks + ([self.partial] if self.partial is not None else [])
        return torch.stack(entries)

    def record(self, output: Tensor) -> None:
        """Add the output f of sublayer `next_sublayer` and close its block when it is the block's last."""
        self.partial = output if self.partial is None else self.partial + output
        block = self.layout.block_of(self.next_sublayer)
        if self.next_sublayer == self.layout.block_end(block):
            self.blocks.append(self.partial)
            self.partial = None
        self.next_sublayer += 1


def attnres_block_phase1(completed: Tensor, queries: Tensor, key_norm_weights: Tensor, eps: float):
    """Phase 1 of the exact two-phase Block AttnRes: all S queries of a block against the completed blocks.

    completed [n, *, d]; queries / key_norm_weights [S, d]. Returns per query the running max m [S, *],
    the sum of exponentials z [S, *] (relative to m) and the unnormalised weighted sum o [S, *, d].
    """
    folded = (_fp32(key_norm_weights) * _fp32(queries)).to(completed.dtype)  # [S, d]
    inv_rms = rms_inverse(completed, eps)  # [n, *]
    logits = _fp32(torch.einsum("n...d,sd->sn...", completed, folded)) * inv_rms.unsqueeze(0)  # [S, n, *]
    m = logits.amax(dim=1)
    p = torch.exp(logits - m.unsqueeze(1))
    z = p.sum(dim=1)
    o = torch.einsum("sn...,n...d->s...d", p.to(completed.dtype), completed)
    return m, z, o


def attnres_block_phase2(
    m: Tensor, z: Tensor, o: Tensor, partial: Optional[Tensor], query: Tensor, key_norm_weight: Tensor, eps: float
) -> Tensor:
    """Phase 2 for one sublayer: merge the partial sum into phase 1's (m, z, o) by an online-softmax update."""
    if partial is None:
        return (_fp32(o) / z.unsqueeze(-1)).to(o.dtype)
    logit = attnres_logits(partial.unsqueeze(0), query, key_norm_weight, eps)[0]
    new_m = torch.maximum(m, logit)
    scale_old = torch.exp(m - new_m)
    scale_new = torch.exp(logit - new_m)
    numerator = _fp32(o) * scale_old.unsqueeze(-1) + _fp32(partial) * scale_new.unsqueeze(-1)
    return (numerator / (z * scale_old + scale_new).unsqueeze(-1)).to(o.dtype)


def attnres_two_phase_block(
    completed: Tensor,
    sublayer_fns: Sequence[Callable[[Tensor], Tensor]],
    mixers: Sequence[AttnResMixer],
) -> List[Tensor]:
    """Run one AttnRes block with the two-phase computation (inference form).

    completed: [n, *, d] the completed blocks b_0..b_{n-1}; sublayer_fns[i](h) -> f_i runs sublayer i of the
    block on its input h; mixers[i] are their AttnRes mixers. Returns the sublayer outputs; their sum is b_n.
    """
    queries = torch.stack([mx.query for mx in mixers])
    gains = torch.stack([mx.key_norm_weight for mx in mixers])
    m, z, o = attnres_block_phase1(completed, queries, gains, mixers[0].eps)
    outputs, partial = [], None
    for i, (fn, mixer) in enumerate(zip(sublayer_fns, mixers)):
        h = attnres_block_phase2(m[i], z[i], o[i], partial, mixer.query, mixer.key_norm_weight, mixer.eps)
        out = fn(h)
        outputs.append(out)
        partial = out if partial is None else partial + out
    return outputs


# --------------------------------------------------------------------------------------------------------------
# DeepCrossAttention (arXiv 2502.06785)
# --------------------------------------------------------------------------------------------------------------

GRN_VERSIONS = ("v1", "v2", "v3")


def dca_num_sources(block: int, last_k: Optional[int]) -> int:
    """Entries of the DCA stack G_t seen by transformer block t (1-based); t = L_b + 1 is the final GRN."""
    produced = block - 1
    if last_k is None or produced <= last_k:
        return 1 + produced
    return last_k + 2


def grn_apply(stack: Tensor, bias: Tensor, proj: Optional[Tensor], version: str) -> Tensor:
    """Generalised residuals of G for several GRN instances at once.

    stack [K, *, d]; bias: v1 [n, K], v2/v3 [n, d, K]; proj (v3 only) [n, d]. Returns [n, *, d]:
      out[g] = sum_i (bias[g, :, i] + ReLU(proj[g] . G[i])) * G[i]
    """
    if version == "v1":
        return torch.einsum("gk,k...d->g...d", bias.to(stack.dtype), stack)
    out = torch.einsum("gdk,k...d->g...d", bias.to(stack.dtype), stack)
    if version == "v3":
        # ReLU with subgradient 1 at 0 (clamp, not torch.relu): proj starts at exactly zero, where torch.relu's
        # zero subgradient would leave the input-dependent term dead for the whole run. Forward is unchanged.
        gate = torch.einsum("k...d,gd->gk...", stack, proj.to(stack.dtype)).clamp(min=0)  # [n, K, *]
        out = out + torch.einsum("gk...,k...d->g...d", gate, stack)
    return out


class GRN(nn.Module):
    """`count` independent GRN instances over a K-entry stack (DCA uses 3 for q/k/v, 1 for the final mix).

    At initialisation (bias ones, proj zero) every instance returns sum_i G[i]: the ordinary residual stream.
    """

    def __init__(self, hidden_size: int, num_sources: int, version: str = "v3", count: int = 1, dtype=None):
        super().__init__()
        if version not in GRN_VERSIONS:
            raise ValueError(f"unknown GRN version {version!r}; choose one of {', '.join(GRN_VERSIONS)}")
        self.version = version
        self.num_sources = num_sources
        shape = (count, num_sources) if version == "v1" else (count, hidden_size, num_sources)
        self.bias = nn.Parameter(torch.ones(shape, dtype=dtype))
        self.proj = nn.Parameter(torch.zeros(count, hidden_size, dtype=dtype)) if version == "v3" else None

    def forward(self, stack: Tensor) -> Tensor:
        if stack.shape[0] != self.num_sources:
            raise ValueError(f"GRN built for {self.num_sources} sources got a stack of {stack.shape[0]}")
        if _RECORDER is not None:
            _record(self, self.mean_weights(stack).mean(0, keepdim=True).T)  # [K, 1]: mean over instances
        return kernel(grn_apply)(stack, self.bias, self.proj, self.version)

    def mean_weights(self, stack: Tensor) -> Tensor:
        """Per-instance, per-source weight averaged over channels and tokens [count, K] (for heatmaps)."""
        b = self.bias.float() if self.version == "v1" else self.bias.float().mean(1)
        if self.version != "v3":
            return b
        gate = torch.einsum("k...d,gd->gk...", stack.float(), self.proj.float()).clamp(min=0)
        return b + gate.flatten(2).mean(-1)


class DCAState:
    """The DCA stack: the embedding, (k-DCA) the sum of older block outputs, and the recent block outputs.

    `next_block` is the 1-based transformer block that reads the stack next.
    """

    def __init__(self, last_k: Optional[int], embedding: Tensor, summed: Optional[Tensor], recent: List[Tensor],
                 next_block: int):
        self.last_k = last_k
        self.embedding = embedding
        self.summed = summed
        self.recent = list(recent)
        self.next_block = next_block

    @classmethod
    def from_embedding(cls, last_k: Optional[int], embedding: Tensor) -> "DCAState":
        return cls(last_k, embedding, None, [], 1)

    def entries(self) -> List[Tensor]:
        return [self.embedding] + ([self.summed] if self.summed is not None else []) + self.recent

    def stack(self) -> Tensor:
        return torch.stack(self.entries())

    def record(self, block_output: Tensor) -> None:
        self.recent.append(block_output)
        if self.last_k is not None and len(self.recent) > self.last_k:
            oldest = self.recent.pop(0)
            self.summed = oldest if self.summed is None else self.summed + oldest
        self.next_block += 1

    @staticmethod
    def has_sum(next_block: int, last_k: Optional[int]) -> bool:
        return last_k is not None and next_block - 1 > last_k

    @staticmethod
    def num_recent(next_block: int, last_k: Optional[int]) -> int:
        produced = next_block - 1
        return produced if last_k is None else min(produced, last_k)


def dca_block(
    state: DCAState,
    grn_qkv: GRN,
    attention: Callable[[Tensor, Tensor, Tensor], Tensor],
    mlp: Callable[[Tensor], Tensor],
) -> Tensor:
    """One DCA transformer block: three GRNs feed Q, K and V; returns f_t = a + m and records it.

    `attention(q_in, k_in, v_in)` applies the pre-norm and attention; `mlp(x)` applies pre-norm and MLP.
    """
    q_in, k_in, v_in = grn_qkv(state.stack()).unbind(0)
    a = attention(q_in, k_in, v_in)
    block_output = a + mlp(a + q_in)
    state.record(block_output)
    return block_output


# --------------------------------------------------------------------------------------------------------------
# Depth-Attention (arXiv 2606.05014)
# --------------------------------------------------------------------------------------------------------------

DEPTH_ATTN_GQA_MODES = ("query", "group")


def depth_attention_candidates(layer: int, stride: Optional[int], window: int) -> List[int]:
    """Earlier layers (0-based) whose key/value layer `layer` mixes: j % stride == 0, plus the last `window`."""
    return [j for j in range(layer) if (stride and j % stride == 0) or j >= layer - window]


def depth_attention_needed_after(layer: int, num_layers: int, stride: Optional[int], window: int) -> List[int]:
    """Layers j <= layer whose stored key/value some layer after `layer` still mixes (what a hop carries)."""
    later = range(layer + 1, num_layers)
    return [j for j in range(layer + 1) if any(j in depth_attention_candidates(l, stride, window) for l in later)]


def _expand_heads(x: Tensor, heads: int) -> Tensor:
    """[*, h, hn] -> [*, heads, hn], repeating each head in place (query group g serves heads g*r .. g*r+r-1)."""
    if x.shape[-2] == heads:
        return x
    return x.repeat_interleave(heads // x.shape[-2], dim=-2)


def depth_attention_mix(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cand_raw_keys: Optional[Tensor],
    cand_values: Optional[Tensor],
    key_norm: Callable[[Tensor], Tensor],
    gqa_mode: str = "query",
    record_key=None,
) -> Tensor:
    """Depth-mixed value of one layer (SPEC.md section 3).

    query [*, hq, hn] after q-norm (RoPE cancels at equal positions, so none is applied); key [*, hkv, hn]
    this layer's normalised key; value [*, hkv, hn]; cand_raw_keys [C, *, hkv, hn] earlier layers' RAW keys;
    cand_values [C, *, hv, hn] their stored (mixed) values. key_norm: this layer's key norm.
    Returns v~ with hq heads ("query": the authors' per-query-head form) or hkv heads ("group": one depth
    weight per key-value head from the mean of its group's queries; keeps the GQA cache size).
    """
    hq, hkv = query.shape[-2], key.shape[-2]
    if cand_raw_keys is None or cand_raw_keys.shape[0] == 0:
        return _expand_heads(value, hq) if gqa_mode == "query" else value
    cand_keys = key_norm(cand_raw_keys)
    keys = torch.cat([cand_keys, key.unsqueeze(0)])  # [C+1, *, hkv, hn]
    if gqa_mode == "query":
        heads = hq
        q = query
    elif gqa_mode == "group":
        heads = hkv
        q = query.unflatten(-2, (hkv, hq // hkv)).mean(-2)
    else:
        raise ValueError(f"unknown depth-attention GQA mode {gqa_mode!r}; choose one of {DEPTH_ATTN_GQA_MODES}")
    values = torch.cat([_expand_heads(cand_values, heads), _expand_heads(value, heads).unsqueeze(0)])
    keys = _expand_heads(keys, heads)
    scores = (_fp32(keys) * _fp32(q).unsqueeze(0)).sum(-1) / math.sqrt(q.shape[-1])  # [C+1, *, heads]
    alpha = torch.softmax(scores, dim=0)
    if record_key is not None:
        _record(record_key, alpha)
    return (alpha.to(value.dtype).unsqueeze(-1) * values).sum(0)


@dataclass
class DepthAttentionState:
    """Stored raw keys and mixed values of earlier layers, by 0-based layer index, plus the residual stream."""

    hidden: Tensor
    raw_keys: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)

    def candidates(self, layer: int, stride: Optional[int], window: int):
        ids = depth_attention_candidates(layer, stride, window)
        if not ids:
            return None, None
        missing = [j for j in ids if j not in self.raw_keys]
        if missing:
            raise RuntimeError(f"depth-attention layer {layer} needs layers {missing}, which were not carried here")
        return torch.stack([self.raw_keys[j] for j in ids]), torch.stack([self.values[j] for j in ids])

    def store(self, layer: int, raw_key: Tensor, value: Tensor, num_layers: int, stride: Optional[int],
              window: int) -> None:
        """Keep this layer's raw key and mixed value, and drop what no later layer needs."""
        self.raw_keys[layer], self.values[layer] = raw_key, value
        keep = set(depth_attention_needed_after(layer, num_layers, stride, window))
        for j in list(self.raw_keys):
            if j not in keep:
                del self.raw_keys[j], self.values[j]
