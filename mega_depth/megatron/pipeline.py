"""A depth-mixing state's trip between pipeline stages: the hop payload, virtual-stage caching, the byte counter.

Megatron's schedules send one tensor per hop and back-propagate only through it, so the mechanism's entries
(base.py: `layout`, `entries`, `state_from`) are flattened to [s_local, b, width] and concatenated on the last
dim (hidden state first where there is one); gradients reach every entry through the concatenation.

Immutable entries never change once made (AttnRes completed blocks, DCA block outputs, Depth-Attention keys and
values), so with virtual stages a rank keeps those it held at its previous chunk of the same micro-batch and the
hop sends only the rest (cross-stage caching; docs/mechanisms.md §11). One `DepthPipeline` per rank holds that stash
and the hop counter; the training step calls `start_step()` before each forward-backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from torch import Tensor

from mega_depth.model.base import Entry


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


def hop_layout(mechanism, geo: StageGeometry, to_stage: int, cache: bool) -> Tuple[List[Entry], List[Entry]]:
    """(sent, cached): the entries the hop into `to_stage` carries, and those its rank already holds.

    With virtual stages the receiving rank ran stage `to_stage - pp` on the same micro-batch; every immutable
    entry that existed at the end of that stage is still there and need not travel again.
    """
    layout = mechanism.layout(geo.start(to_stage))
    if not cache or geo.vpp == 1 or to_stage < geo.pp:
        return layout, []
    held = {e.name for e in mechanism.layout(geo.start(to_stage - geo.pp + 1)) if e.immutable}
    sent = [e for e in layout if not (e.immutable and e.name in held)]
    cached = [e for e in layout if e.immutable and e.name in held]
    return sent, cached


def pack(mechanism, entries: Dict[str, Tensor], layout: List[Entry]) -> Tensor:
    return torch.cat([mechanism.flat(e.name, entries[e.name]) for e in layout], dim=-1)


def unpack(mechanism, packed: Tensor, layout: List[Entry]) -> Dict[str, Tensor]:
    widths = [e.width for e in layout]
    if packed.shape[-1] != sum(widths):
        raise RuntimeError(f"pipeline payload has width {packed.shape[-1]}, expected {sum(widths)} for "
                           f"{[e.name for e in layout]}: the sending stage was built with another model or layout")
    return {e.name: mechanism.unflat(e.name, t) for e, t in zip(layout, packed.split(widths, dim=-1))}


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


class _Stash:
    def __init__(self, tensors: Dict[str, Tensor]):
        self.tensors = tensors
        self.leaves: Dict[str, Tensor] = {}


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


class DepthPipeline:
    """The pipeline side of one rank's depth-mixing model chunks: payloads in and out, the virtual-stage stash
    and the hop counter (instance state: nothing global to reset by hand)."""

    def __init__(self, mechanism, geometry: StageGeometry, cache: bool):
        self.mechanism, self.geometry, self.cache = mechanism, geometry, cache
        self.hops = HopCounter()
        self._stashes: Dict[Tuple[int, int], _Stash] = {}

    def start_step(self) -> None:
        """Drop every cached entry and reset the counter (before each forward-backward pass)."""
        self._stashes.clear()
        self.hops.reset()

    def receive(self, stage: int, microbatch: int, packed: Tensor):
        """The state at the start of `stage` from the received tensor (plus this rank's cached entries)."""
        mech = self.mechanism
        sent, cached = hop_layout(mech, self.geometry, stage, self.cache)
        entries = unpack(mech, packed, sent)
        if cached:
            entries.update(self._take(stage, microbatch, [e.name for e in cached]))
        return mech.state_from(entries, self.geometry.start(stage))

    def send(self, stage: int, microbatch: int, state) -> Tensor:
        """The packed tensor that leaves `stage` for `stage + 1` (caching what this rank's next chunk keeps)."""
        mech, geo = self.mechanism, self.geometry
        entries = mech.entries(state)
        sent, _ = hop_layout(mech, geo, stage + 1, self.cache)
        carrier = sent[0].name
        if self.cache and geo.vpp > 1 and stage + geo.pp < geo.num_stages:
            # This rank runs stage `stage + pp` of the same micro-batch next: keep what it will not receive.
            _, keep = hop_layout(mech, geo, stage + geo.pp, True)
            if keep:
                entries[carrier] = self._stash(entries, [e.name for e in keep], stage + geo.pp, microbatch,
                                               entries[carrier])
        packed = pack(mech, entries, sent)
        self.hops.record(stage + 1, packed)
        return packed

    def _stash(self, entries, names, next_stage, microbatch, carrier):
        stash = _Stash({n: entries[n] for n in names})
        self._stashes[(next_stage, microbatch)] = stash
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in stash.tensors.values()):
            return carrier
        return _AttachCachedGrads.apply(carrier, stash, *stash.tensors.values())

    def _take(self, stage, microbatch, names) -> Dict[str, Tensor]:
        """Cached entries for `stage`, as leaf copies whose grads flow back through the stash."""
        stash = self._stashes.pop((stage, microbatch), None)
        if stash is None or any(n not in stash.tensors for n in names):
            raise RuntimeError(f"virtual-stage cache has no entries {names} for stage {stage}, micro-batch "
                               f"{microbatch}")
        out = {}
        for n in names:
            leaf = stash.tensors[n].detach().requires_grad_(stash.tensors[n].requires_grad)
            stash.leaves[n] = leaf
            out[n] = leaf
        return out


def pipelines_of(model_chunks) -> List[DepthPipeline]:
    """The DepthPipeline of every chunk that has one (one object shared by a rank's chunks)."""
    out = []
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        pipe = getattr(getattr(module, "decoder", None), "pipeline", None)
        if pipe is not None and all(pipe is not p for p in out):
            out.append(pipe)
    return out
