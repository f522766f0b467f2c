"""The gradient norm and its clipping on the device, where neither Transformer Engine nor apex is installed.

megatron-core's fallback for their multi-tensor kernels (`local_multi_tensor_l2_norm`) builds a host tensor from
one device norm per parameter, and `get_grad_norm_fp32` reads the total to the host to decide the clip: one sync
per parameter tensor every step (36 for the 1B baseline on an H200, up to 108 for HC), with the host waiting on
the device each time. Here the norm is `torch._foreach_norm` over every gradient (one pass), reduced over the
same groups as Megatron's, and kept a device scalar; the clip factor min(1, max_norm / (norm + 1e-6)) is applied
on the device with `torch._foreach_mul_`. The optimizer step then makes no sync; the trainer reads the norm
where it logs it. Megatron's own kernels are left alone where TE or apex provides them.

`apply()` is explicit (the Megatron backend calls it before it builds its optimizer) and idempotent.
"""

from __future__ import annotations

import importlib
from typing import List, Optional

import torch

_APPLIED = False


def grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """megatron.core.optimizer.clip_grads.get_grad_norm_fp32, as a device scalar (fp32) for the 2-norm."""
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    if float(norm_type) != 2.0:
        return _original(grads_for_norm, norm_type, grad_stats_parallel_group)
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    data_parallel_group = None
    for grad in grads_for_norm:
        data_parallel_group = clip_grads.get_data_parallel_group_if_dtensor(grad, data_parallel_group)
    grads = [clip_grads.to_local_if_dtensor(g) for g in grads_for_norm]
    if grads:
        squares = torch.stack(torch._foreach_norm(grads, 2.0)).float().square().sum()
    else:
        squares = torch.zeros((), dtype=torch.float32, device=_device())
    if data_parallel_group:
        torch.distributed.all_reduce(squares, op=torch.distributed.ReduceOp.SUM, group=data_parallel_group)
    torch.distributed.all_reduce(squares, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group)
    return squares.sqrt()


def clip_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad: bool = False) -> None:
    """megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32 with the factor on the device."""
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads: List[torch.Tensor] = [clip_grads.to_local_if_dtensor(getattr(p, attr)).detach() for p in parameters
                                 if getattr(p, attr, None) is not None]
    if not grads:
        return
    # the norm is a device scalar from grad_norm_fp32 (a Python float only from a chained optimizer whose groups
    # differ, which reads its parts to the host itself)
    total = total_norm.float() if isinstance(total_norm, torch.Tensor) else \
        torch.full((), float(total_norm), dtype=torch.float32, device=grads[0].device)
    factor = (max_norm / (total + 1.0e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, factor)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


_original = None


def apply() -> bool:
    """Install the device-side norm and clip where megatron-core fell back to its local multi-tensor functions (no
    TE, no apex). Returns whether it did."""
    global _APPLIED, _original
    if _APPLIED:
        return True
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    from megatron.core.utils import local_multi_tensor_applier

    if clip_grads.multi_tensor_applier is not local_multi_tensor_applier:
        return False  # TE's or apex's fused kernels: Megatron's own path
    _original = clip_grads.get_grad_norm_fp32
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer",
                 "megatron.core.optimizer.layer_wise_optimizer"):
        module = importlib.import_module(name)
        module.get_grad_norm_fp32 = grad_norm_fp32
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = clip_by_total_norm_fp32
    _APPLIED = True
    return True


def use_fused_adamw(optimizer) -> int:
    """Torch's fused AdamW (one kernel for every parameter's update) in each torch optimizer Megatron wraps, where
    the parameters live on a GPU; returns how many param groups switched."""
    switched = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer: Optional[torch.optim.Optimizer] = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, torch.optim.AdamW):
            continue
        for group in torch_optimizer.param_groups:
            if group["params"] and group["params"][0].is_cuda:
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched
