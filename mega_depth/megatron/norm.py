"""RMSNorm for Megatron-core specs that works under sequence parallelism, fused on a GPU.

megatron-core's torch fallback norm (WrappedTorchNorm) refuses sequence parallelism, and TransformerEngine is not
always there. This one computes like Llama/Qwen3 (normalise in fp32, cast back, then scale) and tags its weight
`sequence_parallel` so that Megatron all-reduces its grad over the TP group when SP splits the sequence.

Eagerly that is about 20 passes over a [tokens, d] tensor (two fp32 copies, the square, the mean, the scale, the
casts, and as many again in backward), for every norm of every layer, again in every recomputation. On a GPU the
norm runs as Liger-Kernel's fused RMSNorm instead (its "llama" casting: the same computation, one read and one
write a row forward, the weight's gradient from per-SM fp32 partials), where Liger-Kernel is installed (`pip
install "mega_depth[gpu]"`) and the layer is not being compiled (inductor fuses the eager form itself). The eager
form stays the reference and the CPU path; tests/kernels/test_liger.py ties the two under Triton's interpreter.

Liger's kernels take a row stride, but its autograd Function copies a strided input first (ensure_contiguous: a key
split off the fused QKV projection, rows (r + 2) * hn apart, is copied for every q/k norm) and, unless it may
overwrite the output gradient, zero-fills the input gradient before its kernel writes every row of it. `_FusedNorm`
calls the same kernels on the rows as they lie and writes the input gradient into an empty tensor.
"""

import contextlib
import functools
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from mega_depth.kernels import common


@functools.lru_cache(maxsize=None)
def _liger_rms_norm():
    """Liger-Kernel's RMSNorm module (its kernels and launchers), or None where it is not installed (looked up once:
    every norm call asks)."""
    try:
        from liger_kernel.ops import rms_norm
    except ImportError:
        return None
    return rms_norm


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [*, d] as rows [N, d] with unit channel stride, a view where the leading dims merge into one row stride
    (a head split off a fused projection does), else a copy."""
    if x.stride(-1) == 1:
        try:
            return x.view(-1, x.shape[-1])
        except RuntimeError:
            pass
    return x.reshape(-1, x.shape[-1]).contiguous()


def fused_forward(x, weight, eps):
    """Liger's forward on x's rows in place -> (y shaped like x, the state its backward takes: (rstd, launch))."""
    liger = _liger_rms_norm()
    y, _, rstd, block, num_warps, casting = liger.rms_norm_forward(_rows(x), weight, eps, 0.0, "llama", None)
    return y.view_as(x), (rstd, (block, num_warps, casting))


def fused_backward(dy, x, weight, state, needs_dw):
    """The gradients (dx shaped like dy, dw or None) of `fused_forward` from its input x and its state."""
    rstd, launch = state
    dx, dw = _norm_backward(dy.reshape(-1, dy.shape[-1]), _rows(x), weight, rstd, *launch, needs_dw=needs_dw)
    return dx.view_as(dy), dw


class _FusedNorm(torch.autograd.Function):
    """weight * normalise(x) by Liger's kernels ("llama" casting), on x's rows in place (module doc)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, (rstd, ctx.launch) = fused_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = fused_backward(dy, x, weight, (rstd, ctx.launch), ctx.needs_input_grad[1])
        return dx, dw, None


class _RemadeNorm(torch.autograd.Function):
    """_FusedNorm of a sublayer input x = make(*sources) that keeps the sources, not x: backward makes x again,
    outside autograd (one forward call of make's op, no graph, no nested backward pass), and hands x's gradient on
    to make's own node, which the forward recorded as usual. That node must keep only its inputs (the fused ops'
    nodes do), so x itself is kept by no one: what activation checkpointing of norm(make(*sources)) saves, at the
    host cost of one call of make instead of a region's second forward and nested backward pass."""

    @staticmethod
    def forward(ctx, x, weight, eps, make, *sources):
        y, (rstd, ctx.launch) = fused_forward(x, weight, eps)
        ctx.save_for_backward(weight, rstd, *sources)
        ctx.make = make
        return y

    @staticmethod
    def backward(ctx, dy):
        weight, rstd, *sources = ctx.saved_tensors
        with torch.no_grad():
            x = ctx.make(*sources)
        dx, dw = fused_backward(dy, x, weight, (rstd, ctx.launch), ctx.needs_input_grad[1])
        return (dx, dw, None, None) + (None,) * len(sources)


def _norm_backward(dy, rows, weight, rstd, block, num_warps, casting, needs_dw):
    """liger rms_norm_backward (not in place), with the input gradient allocated empty: both of its kernels write
    every row of it. -> (dx [N, d], dw or None)."""
    liger = _liger_rms_norm()
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    n_rows, n_cols = dy.shape
    sm_count = common.gpu_sm_count(rows.device) if rows.is_cuda else 1
    partial_dw = torch.empty((sm_count, n_cols), dtype=torch.float32, device=rows.device) if needs_dw else None
    dx = torch.empty_like(dy)
    args = (dy, dy.stride(0), dx, dx.stride(0), rows, rows.stride(0), liger.torch_to_triton_dtype[rows.dtype], weight,
            weight.stride(0), rstd, rstd.stride(0), partial_dw, partial_dw.stride(0) if needs_dw else 0, n_rows,
            n_cols, 0.0)
    if block > 256 or n_rows < 4096 * 8:  # Liger's own choice of kernel
        liger._rms_norm_backward_kernel[(sm_count,)](
            *args, -(-n_rows // sm_count), casting, elementwise_affine=True, BLOCK_SIZE=block, COMPUTE_DW=needs_dw,
            num_warps=num_warps)
    else:
        liger._block_rms_norm_backward_kernel[(sm_count,)](
            *args, casting, elementwise_affine=True, BLOCK_SIZE=block, BLOCK_ROW=16, COMPUTE_DW=needs_dw,
            num_warps=num_warps)
    return dx, (partial_dw.sum(0).to(weight.dtype) if needs_dw else None)


def fused_applies(x: torch.Tensor) -> bool:
    """Whether the fused kernel runs for `x`: a GPU tensor (or the kernel tests and the step trace, which force
    or record Triton launches), Liger-Kernel importable, outside torch.compile."""
    return (common.uses_triton(x) and not torch.compiler.is_compiling() and _liger_rms_norm() is not None)


class _Remake:
    """What a fused norm's output is made from: its input (which the norm's own node keeps), weight and eps."""

    def __init__(self, x, weight, eps):
        self.x, self.weight, self.eps = x, weight, eps


_MADE_AGAIN: List[Dict[tuple, Tuple[torch.Tensor, _Remake]]] = []  # the open `outputs_made_again` contexts


def _where(t: torch.Tensor) -> tuple:
    """A tensor's place: the tensor its view chain starts from (held alive while the place is looked up, so no other
    tensor takes its id), with the view's offset, shape and strides; an alias of a gradient sink (a whole view) is
    the same place. Not the storage's address: every meta tensor's is 0."""
    root = t if t._base is None else t._base
    return id(root), t.storage_offset(), tuple(t.shape), t.stride()


@contextlib.contextmanager
def _outputs_made_again():
    outputs: Dict[tuple, Tuple[torch.Tensor, _Remake]] = {}  # holds the outputs: no place is reused inside

    def pack(t):
        made = outputs.get(_where(t))
        return t if made is None else made[1]

    def unpack(saved):
        if not isinstance(saved, _Remake):
            return saved
        with torch.no_grad():
            return fused_forward(saved.x, saved.weight, saved.eps)[0]

    _MADE_AGAIN.append(outputs)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _MADE_AGAIN.pop()
        outputs.clear()  # every tensor saved inside keeps the hooks, and pack's closure with them


def outputs_made_again(like: torch.Tensor) -> Optional[contextlib.AbstractContextManager]:
    """A context within which an output of the fused norm that a later op saves for backward is saved as what makes
    it (the norm's input, kept by the norm's own node anyway; the weight; eps) and normalised again when backward
    reads it: the op keeps no normalised copy, with no checkpointed region (no second forward under autograd, no
    nested backward pass; one norm forward kernel again a saved output). Depth-Attention's value mix keeps the
    normalised query and keys of a layer and its candidates this way. None where the fused norm does not run for
    tensors like `like` (the caller checkpoints instead). Saved-tensor hooks opened outside are shadowed inside."""
    return _outputs_made_again() if fused_applies(like) and torch.is_grad_enabled() else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x normalised in fp32, cast to x's dtype): fused where `fused_applies`, else eager."""
    if fused_applies(x):
        y = _FusedNorm.apply(x, weight, eps)
        if _MADE_AGAIN:
            _MADE_AGAIN[-1][_where(y)] = (y, _Remake(x, weight, eps))
        return y
    return eager_rms_norm(x, weight, eps)


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager form (the CPU path, and the reference of every fused form): Llama's casting."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x) -> torch.Tensor:
        if isinstance(x, _Remaking):
            return x.normalise(self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    outputs_made_again = staticmethod(outputs_made_again)  # model/base.norm_outputs_made_again asks the norms

    def remade(self, make, sources, normalised=None):
        """self(make(*sources)) keeping the sources instead of make's output, where the fused kernel runs
        (`_RemadeNorm`; make's autograd node must keep only its inputs); None elsewhere (the caller checkpoints).
        normalised(weight, eps, *sources): the mechanism's op that makes the input and normalises it as this norm
        does (Llama's casting), in one kernel each way: then the input is never written, nor read or made again."""
        first = next((t for t in sources if t is not None), None)
        if first is None or not fused_applies(first):
            return None
        # through the module's call, as any use of the norm: its hooks run (DeepSpeed ZeRO-3 gathers the weight in
        # one and registers the one that gathers it again for backward; Megatron's --overlap-param-gather waits in
        # one for the weight's all-gather)
        return self(_Remaking(make, sources, normalised))

    def folded(self, op, like):
        """op(weight, eps) through the module's call, as any use of the norm (its hooks run, as in `remade`): a
        mechanism's op that applies this norm inside its own kernel (Llama's casting) to tensors it reads, where the
        fused kernel runs for tensors like `like`; None elsewhere (the caller normalises with the module)."""
        if not fused_applies(like):
            return None
        return self(_Remaking(None, (), lambda weight, eps: op(weight, eps)))


class _Remaking:
    """RMSNorm.remade's input, handed through the module's call: make(*sources), or normalised(weight, eps,
    *sources) where the mechanism has that op."""

    def __init__(self, make, sources, normalised):
        self.make, self.sources, self.normalised = make, sources, normalised

    def normalise(self, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.normalised is not None:
            return self.normalised(weight, eps, *self.sources)
        x = self.make(*self.sources)
        if not torch.is_grad_enabled():
            return rms_norm(x, weight, eps)
        return _RemadeNorm.apply(x, weight, eps, self.make, *self.sources)
