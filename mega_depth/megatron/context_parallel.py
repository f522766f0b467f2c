"""Context parallelism (CP) for the SDPA core attention: each sequence split over the CP group, K and V all-gathered.

The split is Megatron's load-balanced one (`get_batch_on_this_cp_rank`): the sequence is cut into 2·CP chunks of
L = s / (2·CP) tokens and CP rank r holds chunks r and 2·CP-1-r, so every rank has the same causal work. Megatron's
RoPE (`get_pos_emb_on_this_cp_rank`) selects the same chunks, so positions follow them.

Attention is all-gather CP, as Llama 3 trained and as Transformer Engine's `all_gather` mode: K and V are gathered
over the group (their gradients reduce-scattered back) and each local query chunk c attends keys 0 .. (c+1)·L - 1
with the causal mask aligned to its bottom-right corner (`causal_lower_right`: keys before the chunk all visible,
the chunk itself causal). GQA keeps its smaller K and V (`enable_gqa`). Everything else in a layer, the depth mixing
of every mechanism included, is per token and runs on the local chunks unchanged.

Memory: the forward saves the local K and V shards, not the gathered ones; backward gathers them again (once per
layer and tensor, shared by both chunks), as Transformer Engine's all-gather CP does. So each rank keeps 1/CP of
the attention activations.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from mega_depth.kernels import saved_bytes


# torch 2.13 renamed the single-tensor collectives; the GPU machine's torch may predate the new names
_all_gather_into = getattr(torch.distributed, "all_gather_single", torch.distributed.all_gather_into_tensor)


def chunk_ids(cp_size: int, cp_rank: int) -> List[int]:
    """The two global chunks (of 2·CP) that CP rank `cp_rank` holds, in the order it holds them."""
    return [cp_rank, 2 * cp_size - 1 - cp_rank]


def split_batch(batch: Dict[str, Tensor], cp_size: int, cp_rank: int) -> Dict[str, Tensor]:
    """This CP rank's part of a micro-batch: every [b, s] tensor -> [b, s / CP], its two chunks side by side."""
    if cp_size == 1:
        return batch
    ids = chunk_ids(cp_size, cp_rank)
    out = {}
    for name, t in batch.items():
        b, s = t.shape[:2]
        chunks = t.reshape(b, 2 * cp_size, s // (2 * cp_size), *t.shape[2:])
        out[name] = chunks[:, ids].reshape(b, s // cp_size, *t.shape[2:])
    return out


def _natural_order(cp_size: int) -> List[int]:
    """Positions, in the rank-major gathered tensor [rank 0's two chunks, rank 1's, ...], of chunks 0 .. 2·CP-1."""
    where = {}
    for rank in range(cp_size):
        for slot, chunk in enumerate(chunk_ids(cp_size, rank)):
            where[chunk] = 2 * rank + slot
    return [where[c] for c in range(2 * cp_size)]


def _all_gather(local: Tensor, group) -> Tensor:
    """[s_local, ...] -> [CP·s_local, ...] in rank order, outside autograd (backward's regather)."""
    full = torch.empty((local.shape[0] * group.size(), *local.shape[1:]), dtype=local.dtype, device=local.device)
    _all_gather_into(full, local.contiguous(), group=group)
    return full


class _Regather:
    """What a saved view of a gathered K or V keeps instead of it: the local shard. Backward gathers the full tensor
    again on first use and shares it among the views saved from it (both query chunks)."""

    def __init__(self, local: Tensor, group, cp_size: int):
        self.local, self.group, self.cp_size = local.detach(), group, cp_size
        self._full = None

    def full(self) -> Tensor:
        if self._full is None:
            self._full = _to_natural(_all_gather(self.local, self.group), self.cp_size)
        return self._full


class _SavedView:
    def __init__(self, source: _Regather, view: Tensor):
        self.source = source
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def unpack(self) -> Tensor:
        return self.source.full().as_strided(self.size, self.stride, self.offset)


def _to_natural(gathered: Tensor, cp_size: int) -> Tensor:
    """[CP·s_local, ...] rank order -> the sequence in its natural order."""
    chunks = gathered.reshape(2 * cp_size, gathered.shape[0] // (2 * cp_size), *gathered.shape[1:])
    order = torch.tensor(_natural_order(cp_size), device=gathered.device)
    return chunks.index_select(0, order).reshape(gathered.shape)


def attention(query: Tensor, key: Tensor, value: Tensor, group, *, scale, dropout_p: float) -> Tensor:
    """Causal all-gather CP attention of this rank's chunks.

    query [s_local, b, np, hn], key / value [s_local, b, ng, hn] (this rank's two chunks, s_local = 2·L)
    -> context [b, np, s_local, hn].
    """
    cp_size, cp_rank = group.size(), group.rank()
    sources = {}
    full = []
    for local in (key, value):
        # Megatron's SP gather over the CP group: backward reduce-scatters, so a rank's shard gets the sum of what
        # every rank's queries put on it
        gathered = _to_natural(gather_from_sequence_parallel_region(local, group=group), cp_size)  # [s, b, ng, hn]
        sources[gathered.untyped_storage().data_ptr()] = _Regather(local, group, cp_size)
        full.append(gathered.permute(1, 2, 0, 3))  # [b, ng, s, hn]
    k_all, v_all = full
    q = query.permute(1, 2, 0, 3)  # [b, np, s_local, hn]
    chunk_len = q.shape[2] // 2
    gqa = q.shape[1] != k_all.shape[1]

    def pack(t: Tensor):
        source = sources.get(t.untyped_storage().data_ptr())
        if source is None:
            saved_bytes.note_kept(t)
            return t
        saved_bytes.note_kept(source.local)
        return _SavedView(source, t)

    def unpack(packed):
        return packed.unpack() if isinstance(packed, _SavedView) else packed

    outs = []
    # A compiled layer keeps the gathered K and V (Dynamo does not trace saved-tensor hooks).
    hooks = contextlib.nullcontext() if torch.compiler.is_compiling() else \
        torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    with hooks:
        for slot, chunk in enumerate(chunk_ids(cp_size, cp_rank)):
            q_chunk = q[:, :, slot * chunk_len:(slot + 1) * chunk_len]
            visible = (chunk + 1) * chunk_len
            mask = causal_lower_right(chunk_len, visible)
            outs.append(F.scaled_dot_product_attention(
                q_chunk, k_all[:, :, :visible], v_all[:, :, :visible], attn_mask=mask, dropout_p=dropout_p,
                scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)

