"""Layout-independent views of a sharded model: full (TP-gathered) tensors under global parameter names,
so that runs in different parallel layouts can be compared (the layout tests compare step-1 gradients)."""

from __future__ import annotations

from typing import Callable, Dict

import torch
from megatron.core import parallel_state

from mega_depth.megatron.builder import global_param_name


def _gather_tp(t: torch.Tensor, param) -> torch.Tensor:
    """This rank's TP shard -> the full tensor (inverse of builder.init_layout_independent's sharding)."""
    if not getattr(param, "tensor_model_parallel", False) or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return t
    group = parallel_state.get_tensor_model_parallel_group()
    tp = group.size()
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [p.chunk(stride, dim=dim) for p in parts]  # pieces[rank][k]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(tp)], dim=dim)


def full_tensors(model_chunks, pick: Callable) -> Dict[str, torch.Tensor]:
    """{global name: full tensor of pick(param)} for this rank's pipeline stages (collective over TP)."""
    out = {}
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        first_layer = module.decoder.layers[0].layer_number - 1 if len(module.decoder.layers) else 0
        for name, param in module.named_parameters():
            value = pick(param)
            if value is None:
                continue
            # clone: main_grad is a view into a buffer that the next step overwrites
            out[global_param_name(name, first_layer)] = _gather_tp(value.detach().float(), param).cpu().clone()
    return out


def full_grads(model_chunks) -> Dict[str, torch.Tensor]:
    return full_tensors(model_chunks, lambda p: getattr(p, "main_grad", None) if getattr(p, "main_grad", None)
                        is not None else p.grad)
