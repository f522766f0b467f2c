"""Query, key and value from three different inputs (DCA) through the rows of Megatron's fused linear_qkv weight.

`project_rows`: each input meets only its rows of the weight ([ng, q heads of the group | k | v, hn] rows), so the
three projections cost the FLOPs of one.

`RecomputedQKVProjection` (the fast path, --mixing-impl compiled|triton): the same projection, but neither the
mechanism's q/k/v inputs nor their normalised forms are kept for backward. They are recomputed there from the
sources they were mixed from (checkpointed aggregation, as the AttnRes paper does for its mixing), and the
projection's backward GEMMs run on the recomputed inputs: the forward GEMMs are not re-run and no slice of the
weight is copied for backward. Saved: the sources (which the mechanism's state keeps anyway) and the weight
parameter. Under SP the inputs are all-gathered again in backward, as Megatron's own column-parallel linear does.

`RemadeQKVProjection` (the fused path with the fused norm): the same savings without the region's second forward
under autograd and its nested backward pass, which cost the host more than the GPU's work of the layer's mixing.
The mechanism's mixing runs once under autograd (its op's node keeps only the sources); the Function takes its three
outputs, normalises and projects them, and keeps the sources and the norm's rstd. Backward makes the inputs again
outside autograd (one call of the mixing op), runs the projection's and the norm's backward kernels and hands the
inputs' gradients on to the mixing's node in the step's own backward pass.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    _reduce,
    _reduce_scatter_along_first_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from torch import Tensor

from mega_depth.kernels import grad_sink
from mega_depth.megatron import norm as fused_norm


def _rows(r: int) -> Tuple[slice, slice, slice]:
    """The query, key and value rows within one query group of the fused weight."""
    return slice(0, r), slice(r, r + 1), slice(r + 1, r + 2)


def project_rows(inputs: Sequence[Tensor], weight: Tensor, bias: Optional[Tensor], groups: int, heads_per_group: int,
                 head_dim: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(q_in, k_in, v_in), each [s, b, h] -> query [s, b, ng*r, hn], raw key [s, b, ng, hn], value [s, b, ng, hn]."""
    w = weight.view(groups, heads_per_group + 2, head_dim, -1)
    b = bias.view(groups, heads_per_group + 2, head_dim) if bias is not None else None
    out = []
    for x, rows in zip(inputs, _rows(heads_per_group)):
        w_rows = w[:, rows].reshape(-1, w.shape[-1])
        b_rows = b[:, rows].reshape(-1) if b is not None else None
        out.append(F.linear(x, w_rows, b_rows).view(*x.shape[:2], -1, head_dim))
    return out[0], out[1], out[2]


def project_rows_backward(inputs: Sequence[Tensor], grads: Sequence[Optional[Tensor]], weight: Tensor,
                          bias: Optional[Tensor], groups: int, heads_per_group: int, head_dim: int,
                          out: Optional[Sequence[Tensor]] = None):
    """The input, weight and bias gradients of `project_rows` from its inputs: two GEMMs per input, as F.linear's
    backward computes them; `out`: contiguous tensors shaped like the inputs that take their gradients."""
    d = weight.shape[-1]
    w = weight.view(groups, heads_per_group + 2, head_dim, d)
    # every row block is written where all three gradients arrive (the usual case): no zero fill then
    fresh = torch.empty_like if all(g is not None for g in grads) else torch.zeros_like
    d_weight = fresh(w)
    d_bias = fresh(w[..., 0], dtype=bias.dtype) if bias is not None else None
    d_inputs: List[Tensor] = []
    for x, grad, rows in zip(inputs, grads, _rows(heads_per_group)):
        n = rows.stop - rows.start
        into = out[len(d_inputs)] if out is not None else None
        if grad is None:
            d_inputs.append(into.zero_() if into is not None else torch.zeros_like(x))
            continue
        g = grad.reshape(-1, groups * n * head_dim)  # [s*b, rows]
        if into is not None:
            d_inputs.append(torch.mm(g, w[:, rows].reshape(-1, d), out=into.view(-1, d)).view_as(x))
        else:
            d_inputs.append((g @ w[:, rows].reshape(-1, d)).view_as(x))
        d_weight[:, rows] = (g.t() @ x.reshape(-1, d)).view(groups, n, head_dim, d)
        if d_bias is not None:
            d_bias[:, rows] = g.sum(0).view(groups, n, head_dim)
    return d_inputs, d_weight.view_as(weight), (d_bias.view_as(bias) if d_bias is not None else None)


def _to_projection(x: Tensor, attention) -> Tensor:
    """linear_qkv's input path, forward: all-gather of the sequence under SP, identity otherwise."""
    return _gather_along_first_dim(x, attention.tp_group) if attention.config.sequence_parallel else x


def _from_projection(grad: Tensor, attention) -> Tensor:
    """linear_qkv's input path, backward: reduce-scatter under SP, all-reduce under TP, identity otherwise."""
    if attention.config.sequence_parallel:
        return _reduce_scatter_along_first_dim(grad, attention.tp_group)
    return _reduce(grad, attention.tp_group) if attention.world_size > 1 else grad


def _dims(attention) -> Tuple[int, int, int]:
    groups = attention.num_query_groups_per_partition
    return groups, attention.num_attention_heads_per_partition // groups, attention.hidden_size_per_attention_head


def _normalised(norm, q_in: Tensor, k_in: Tensor, v_in: Tensor) -> List[Tensor]:
    """The three inputs normalised, each its own contiguous [s(/tp), b, h]: each projection is then one GEMM (a
    strided slice of one [s, 3b, h] buffer made every F.linear a batched GEMM over the sequence)."""
    return [norm(q_in), norm(k_in), norm(v_in)]


def project_separate(attention, norm, q_in: Tensor, k_in: Tensor, v_in: Tensor):
    """The eager path: norm each input, take linear_qkv's input path, project (autograd keeps what it needs)."""
    inputs = _normalised(norm, q_in, k_in, v_in)
    if attention.config.sequence_parallel:
        inputs = [gather_from_sequence_parallel_region(x, group=attention.tp_group) for x in inputs]
    elif attention.world_size > 1:
        # one copy into the TP region for the three, stacked along the sequence: megatron-core's all-reduce of the
        # input gradient reduces only a contiguous gradient (a non-contiguous one is reduced in a copy and lost),
        # and the chunks of a dim-0 concatenation are contiguous, as are their concatenated gradients
        inputs = copy_to_tensor_model_parallel_region(torch.cat(inputs), group=attention.tp_group).chunk(3)
    lin = attention.linear_qkv
    return project_rows(inputs, lin.weight, getattr(lin, "bias", None), *_dims(attention))


class RecomputedQKVProjection(torch.autograd.Function):
    """sources -> (q_in, query, raw key, value), keeping only the sources and the weight (module doc).

    make_inputs(*sources) -> (q_in, k_in, v_in) stacked [3, s(/tp), b, h] is the mechanism's mixing; q_in is also
    returned raw (DCA's MLP reads a + q_in). Its parameters, and the norm's, get their gradients through autograd in
    backward, as under reentrant activation checkpointing.
    """

    @staticmethod
    def forward(ctx, attention, norm, make_inputs: Callable, weight: Tensor, bias: Optional[Tensor],
                *sources: Tensor):
        with torch.no_grad():
            q_in, k_in, v_in = make_inputs(*sources).unbind(0)
            inputs = [_to_projection(x, attention) for x in _normalised(norm, q_in, k_in, v_in)]
            query, raw_key, value = project_rows(inputs, weight, bias, *_dims(attention))
        ctx.attention, ctx.norm, ctx.make_inputs = attention, norm, make_inputs
        ctx.save_for_backward(weight, bias, *sources)
        return q_in, query, raw_key, value

    @staticmethod
    def backward(ctx, d_q_in, d_query, d_key, d_value):
        weight, bias, *sources = ctx.saved_tensors
        attention = ctx.attention
        # the copies keep their sources' gradient sinks: the mixing's readers add into the buffers of the outer pass
        leaves = [grad_sink.share(s.detach().requires_grad_(s.requires_grad), s) for s in sources]
        with torch.enable_grad():
            q_in, k_in, v_in = ctx.make_inputs(*leaves).unbind(0)
            normed = _normalised(ctx.norm, q_in, k_in, v_in)
        inputs = [_to_projection(x.detach(), attention) for x in normed]
        d_inputs, d_weight, d_bias = project_rows_backward(inputs, (d_query, d_key, d_value), weight, bias,
                                                           *_dims(attention))
        outputs, grads = list(normed), [_from_projection(d, attention) for d in d_inputs]
        if d_q_in is not None:
            outputs.append(q_in)
            grads.append(d_q_in)
        with grad_sink.for_the_caller():
            torch.autograd.backward(outputs, grads)
        return (None, None, None, d_weight, d_bias) + tuple(leaf.grad for leaf in leaves)


class RemadeQKVProjection(torch.autograd.Function):
    """qkv_in [3, s(/tp), b, h] = make_inputs(*sources) (q_in, k_in, v_in stacked) -> (q_in, query, raw key, value)
    through the fused norm (norm_weight, eps) and linear_qkv's rows, keeping the sources and the rstd of the 3 * N
    rows, not the inputs (module doc). The three inputs are normalised as one [3 N, h] call each way (one weight),
    and q_in comes back as a view of qkv_in (DCA's MLP reads a + q_in): its gradient joins the norm's input gradient
    in backward, and qkv_in's gradient is one buffer, not three stacked by autograd."""

    @staticmethod
    def forward(ctx, attention, eps: float, make_inputs: Callable, norm_weight: Tensor, weight: Tensor,
                bias: Optional[Tensor], qkv_in: Tensor, *sources: Tensor):
        normed, (rstd, ctx.launch) = fused_norm.fused_forward(qkv_in, norm_weight, eps)
        inputs = [_to_projection(x, attention) for x in normed.unbind(0)]
        query, raw_key, value = project_rows(inputs, weight, bias, *_dims(attention))
        ctx.attention, ctx.eps, ctx.make_inputs = attention, eps, make_inputs
        ctx.save_for_backward(norm_weight, weight, bias, rstd, *sources)
        return qkv_in[0], query, raw_key, value

    @staticmethod
    def backward(ctx, d_q_in, d_query, d_key, d_value):
        norm_weight, weight, bias, rstd, *sources = ctx.saved_tensors
        attention = ctx.attention
        with torch.no_grad():
            made = ctx.make_inputs(*sources)
        # the normalised inputs again (the projection's weight gradient reads them): the norm's forward kernel
        normed = fused_norm.fused_forward(made, norm_weight, ctx.eps)[0]
        inputs = [_to_projection(x, attention) for x in normed.unbind(0)]
        sequence_parallel = attention.config.sequence_parallel
        d_made = torch.empty_like(made)  # the projection writes its input gradients here (outside SP)
        d_inputs, d_weight, d_bias = project_rows_backward(
            inputs, (d_query, d_key, d_value), weight, bias, *_dims(attention),
            out=None if sequence_parallel else list(d_made.unbind(0)))
        for slot, d in zip(d_made.unbind(0), d_inputs):
            reduced = _from_projection(d, attention)  # SP: reduce-scattered into a new tensor; TP: all-reduced in place
            if sequence_parallel or reduced is not d:
                slot.copy_(reduced)
        d_x, d_norm_weight = fused_norm.fused_backward(d_made, made, norm_weight, (rstd, ctx.launch),
                                                       ctx.needs_input_grad[3])
        if d_q_in is not None:  # the raw q_in's own readers (DCA's MLP), after the norm
            d_x[0] += d_q_in
        return (None, None, None, d_norm_weight, d_weight, d_bias, d_x) + (None,) * len(sources)
