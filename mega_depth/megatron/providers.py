"""Residual providers: the cross-layer state of each mechanism on Megatron-core, and its trip between stages.

A provider turns the state of mega_depth.mixing into named entries and back:
- `layout(boundary)`: the entries (name, width per token, immutable?) that exist before global layer `boundary`
  (0-based; boundary == num_layers is after the last layer);
- `entries(state)` / `state_from(entries, boundary)`.
Immutable entries never change once made (AttnRes completed blocks, DCA block outputs, Depth-Attention keys and
values), so with virtual pipeline stages a rank keeps those it held at its previous chunk of the same micro-batch
and the hop sends only the rest (SPEC.md section 4, cross-stage caching).

Pipeline payload: Megatron's schedules send one tensor per hop and back-propagate only through it, so every entry
is flattened to [s_local, b, width] and concatenated on the last dim (hidden state first where there is one);
gradients reach every entry through the concatenation. Entry tensors that are sequence-complete under sequence
parallelism (Depth-Attention's per-head keys/values) are folded to the local sequence shard without communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from mega_depth import mixing
from mega_depth.config import Config


@dataclass(frozen=True)
class Entry:
    name: str
    width: int  # elements per (token, sample) in the packed tensor
    immutable: bool


class Provider:
    """Base: geometry shared by all providers. `tp` / `sequence_parallel` only set packed widths."""

    def __init__(self, cfg: Config, tp_size: int):
        self.cfg = cfg
        self.num_layers = cfg.model.num_layers
        self.hidden = cfg.model.hidden_size
        self.tp = tp_size
        self.sp = cfg.parallel.sequence_parallel

    # --- per mechanism -------------------------------------------------------------------------------------
    def layout(self, boundary: int) -> List[Entry]:
        raise NotImplementedError

    def initial_state(self, embedding: Tensor):
        raise NotImplementedError

    def entries(self, state) -> Dict[str, Tensor]:
        raise NotImplementedError

    def state_from(self, entries: Dict[str, Tensor], boundary: int):
        raise NotImplementedError

    def final_hidden(self, state, block) -> Tensor:
        raise NotImplementedError

    # --- packing ---------------------------------------------------------------------------------------------
    def _flat(self, name: str, t: Tensor) -> Tensor:
        return t

    def _unflat(self, name: str, t: Tensor) -> Tensor:
        return t

    def pack(self, entries: Dict[str, Tensor], layout: List[Entry]) -> Tensor:
        return torch.cat([self._flat(e.name, entries[e.name]) for e in layout], dim=-1)

    def unpack(self, packed: Tensor, layout: List[Entry]) -> Dict[str, Tensor]:
        widths = [e.width for e in layout]
        if packed.shape[-1] != sum(widths):
            raise RuntimeError(
                f"pipeline payload has width {packed.shape[-1]}, expected {sum(widths)} for "
                f"{[e.name for e in layout]}: the sending stage was built with another model or layout"
            )
        return {e.name: self._unflat(e.name, t) for e, t in zip(layout, packed.split(widths, dim=-1))}


class AttnResProvider(Provider):
    def __init__(self, cfg: Config, tp_size: int):
        super().__init__(cfg, tp_size)
        blocks = cfg.residual.attnres_num_blocks or cfg.num_sublayers
        self.attnres_layout = mixing.AttnResLayout(cfg.num_sublayers, blocks)

    def layout(self, boundary):
        sublayer = 2 * boundary + 1
        lay = self.attnres_layout
        out = [Entry(f"block{n}", self.hidden, True) for n in range(1 + lay.completed_blocks_before(sublayer))]
        if lay.has_partial_before(sublayer):
            out.append(Entry("partial", self.hidden, False))
        return out

    def initial_state(self, embedding):
        return mixing.AttnResState.from_embedding(self.attnres_layout, embedding)

    def entries(self, state):
        out = {f"block{n}": b for n, b in enumerate(state.blocks)}
        if state.partial is not None:
            out["partial"] = state.partial
        return out

    def state_from(self, entries, boundary):
        n_blocks = 1 + self.attnres_layout.completed_blocks_before(2 * boundary + 1)
        blocks = [entries[f"block{n}"] for n in range(n_blocks)]
        return mixing.AttnResState(self.attnres_layout, blocks, entries.get("partial"), 2 * boundary + 1)

    def final_hidden(self, state, block):
        return block.final_mixer(state.sources())


class DCAProvider(Provider):
    def __init__(self, cfg: Config, tp_size: int):
        super().__init__(cfg, tp_size)
        self.last_k = cfg.residual.dca_last_k

    def layout(self, boundary):
        t = boundary + 1  # next 1-based block
        out = [Entry("x", self.hidden, True)]
        if mixing.DCAState.has_sum(t, self.last_k):
            out.append(Entry("sum", self.hidden, False))
        produced, recent = t - 1, mixing.DCAState.num_recent(t, self.last_k)
        out += [Entry(f"f{j}", self.hidden, True) for j in range(produced - recent + 1, produced + 1)]
        return out

    def initial_state(self, embedding):
        return mixing.DCAState.from_embedding(self.last_k, embedding)

    def entries(self, state):
        out = {"x": state.embedding}
        if state.summed is not None:
            out["sum"] = state.summed
        produced = state.next_block - 1
        for i, f in enumerate(state.recent):
            out[f"f{produced - len(state.recent) + 1 + i}"] = f
        return out

    def state_from(self, entries, boundary):
        t = boundary + 1
        recent = [entries[e.name] for e in self.layout(boundary) if e.name.startswith("f")]
        return mixing.DCAState(self.last_k, entries["x"], entries.get("sum"), recent, t)

    def final_hidden(self, state, block):
        return block.final_grn(state.stack())[0]


class DepthAttentionProvider(Provider):
    def __init__(self, cfg: Config, tp_size: int):
        super().__init__(cfg, tp_size)
        m, r = cfg.model, cfg.residual
        self.head_dim = m.hidden_size // m.num_attention_heads
        self.kv_heads = m.query_groups // tp_size
        self.v_heads = (m.num_attention_heads if r.depth_attn_gqa == "query" else m.query_groups) // tp_size
        self.stride, self.window = r.depth_attn_stride, r.depth_attn_window
        # Under SP the keys/values are sequence-complete on every TP rank; they travel folded to [s/tp, b, tp*w].
        self.fold = tp_size if self.sp else 1

    def layout(self, boundary):
        out = [Entry("hidden", self.hidden, False)]
        kept = mixing.depth_attention_needed_after(boundary - 1, self.num_layers, self.stride, self.window)
        for j in kept:
            out.append(Entry(f"k{j}", self.fold * self.kv_heads * self.head_dim, True))
            out.append(Entry(f"v{j}", self.fold * self.v_heads * self.head_dim, True))
        return out

    def initial_state(self, embedding):
        return mixing.DepthAttentionState(embedding)

    def entries(self, state):
        out = {"hidden": state.hidden}
        for j in state.raw_keys:
            out[f"k{j}"], out[f"v{j}"] = state.raw_keys[j], state.values[j]
        return out

    def state_from(self, entries, boundary):
        state = mixing.DepthAttentionState(entries["hidden"])
        for name, t in entries.items():
            if name[0] == "k":
                state.raw_keys[int(name[1:])] = t
            elif name[0] == "v":
                state.values[int(name[1:])] = t
        return state

    def final_hidden(self, state, block):
        return state.hidden

    def _flat(self, name, t):
        if name == "hidden":
            return t
        s, b = t.shape[:2]
        t = t.reshape(s, b, -1)  # [s, b, heads * hn]
        if self.fold > 1:  # [s, b, w] -> [s/tp, b, tp * w], position-major chunks
            t = t.view(self.fold, s // self.fold, b, -1).permute(1, 2, 0, 3).reshape(s // self.fold, b, -1)
        return t

    def _unflat(self, name, t):
        if name == "hidden":
            return t
        s_local, b = t.shape[:2]
        if self.fold > 1:
            t = t.view(s_local, b, self.fold, -1).permute(2, 0, 1, 3).reshape(self.fold * s_local, b, -1)
        return t.view(t.shape[0], b, -1, self.head_dim)


PROVIDERS = {
    "attnres": AttnResProvider,
    "dca": DCAProvider,
    "depth-attention": DepthAttentionProvider,
}


def make_provider(cfg: Config, tp_size: int) -> Provider:
    return PROVIDERS[cfg.residual.residual](cfg, tp_size)


# ----------------------------------------------------------------------------------------------------------------
# Stage geometry and the hop payload (with or without virtual-stage caching)
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageGeometry:
    num_layers: int
    pp: int
    vpp: int  # virtual stages per rank (1 = plain 1F1B)

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.num_stages

    def start(self, stage: int) -> int:
        return stage * self.layers_per_stage

    def stage_of_first_layer(self, layer: int) -> int:
        return layer // self.layers_per_stage


def hop_layout(provider: Provider, geo: StageGeometry, to_stage: int, cache: bool) -> Tuple[List[Entry], List[Entry]]:
    """(sent, cached): the entries the hop into `to_stage` carries, and those its rank already holds.

    With virtual stages the receiving rank ran stage `to_stage - pp` on the same micro-batch; every immutable
    entry that existed at the end of that stage is still there and need not travel again.
    """
    layout = provider.layout(geo.start(to_stage))
    if not cache or geo.vpp == 1 or to_stage < geo.pp:
        return layout, []
    held = {e.name for e in provider.layout(geo.start(to_stage - geo.pp + 1)) if e.immutable}
    sent = [e for e in layout if not (e.immutable and e.name in held)]
    cached = [e for e in layout if e.immutable and e.name in held]
    return sent, cached


class HopCounter:
    """Bytes each pipeline hop carried, observable for benchmarks: {to_stage: [bytes per micro-batch, ...]}."""

    def __init__(self):
        self.bytes: Dict[int, List[int]] = {}
        self.widths: Dict[int, int] = {}

    def record(self, to_stage: int, packed: Tensor) -> None:
        self.bytes.setdefault(to_stage, []).append(packed.numel() * packed.element_size())
        self.widths[to_stage] = packed.shape[-1]

    def reset(self) -> None:
        self.bytes.clear()
        self.widths.clear()


HOP_COUNTER = HopCounter()


# ----------------------------------------------------------------------------------------------------------------
# Virtual-stage cache: entries a rank keeps for its next chunk of the same micro-batch
# ----------------------------------------------------------------------------------------------------------------


class _Stash:
    def __init__(self, tensors: Dict[str, Tensor]):
        self.tensors = tensors
        self.leaves: Dict[str, Tensor] = {}


_STASHES: Dict[Tuple[int, int], _Stash] = {}


def clear_stashes() -> None:
    """Drop every cached entry (call at the start of each forward-backward pass)."""
    _STASHES.clear()


class _AttachCachedGrads(torch.autograd.Function):
    """Identity on `carrier`; in backward, hands the cached entries the grads that the later chunk put on its
    leaf copies (that chunk's backward always runs first: it is downstream of this one)."""

    @staticmethod
    def forward(ctx, carrier, stash, *cached):
        ctx.stash = stash
        ctx.names = list(stash.tensors)
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad):
        leaves = ctx.stash.leaves
        grads = []
        for name in ctx.names:
            leaf = leaves.get(name)
            g = leaf.grad if leaf is not None else None
            grads.append(g if g is not None else torch.zeros_like(ctx.stash.tensors[name]))
        ctx.stash.tensors.clear()
        ctx.stash.leaves.clear()
        return (grad, None, *grads)


def stash_for_next_chunk(entries: Dict[str, Tensor], names: List[str], next_stage: int, microbatch: int,
                         carrier: Tensor) -> Tensor:
    """Keep `names` for this rank's next chunk of `microbatch`; returns the carrier with the grad hook attached."""
    stash = _Stash({n: entries[n] for n in names})
    _STASHES[(next_stage, microbatch)] = stash
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in stash.tensors.values()):
        return carrier
    return _AttachCachedGrads.apply(carrier, stash, *stash.tensors.values())


def take_stash(stage: int, microbatch: int, names: List[str]) -> Dict[str, Tensor]:
    """Cached entries for `stage`, as leaf copies whose grads flow back through the stash."""
    stash = _STASHES.pop((stage, microbatch), None)
    if stash is None or any(n not in stash.tensors for n in names):
        raise RuntimeError(f"virtual-stage cache has no entries {names} for stage {stage}, micro-batch {microbatch}")
    out = {}
    for n in names:
        leaf = stash.tensors[n].detach().requires_grad_(stash.tensors[n].requires_grad)
        stash.leaves[n] = leaf
        out[n] = leaf
    return out
