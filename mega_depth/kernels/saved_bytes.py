"""Activation memory as autograd sees it: the bytes a forward saves for backward, on any device.

Counted with torch.autograd.graph.saved_tensors_hooks over unique storages, parameters excluded. Only what the
forward saves: it stays alive until its backward, so storages are unique by address. What a recomputing Function
saves again inside backward is transient (one region at a time) and is not counted. The figure does not depend on
the machine (a GPU keeps the same tensors), so a CPU run shows the fused paths' memory contract too.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List

import torch


# The counting hooks of the measurements in progress: a saved-tensor hook nested inside one (which hides the tensors
# from it) reports through note_kept what it really keeps.
_counters: List[Callable[[torch.Tensor], None]] = []


def note_kept(t: torch.Tensor) -> None:
    """Called by nested saved-tensor hooks (megatron/context_parallel.py) with each tensor they keep."""
    for count in _counters:
        count(t)


def saved_for_backward_bytes(run: Callable[[], object], parameters: Iterable[torch.Tensor]) -> int:
    """Run `run()` (a forward, or a forward and its backward) and return the bytes its forward saved."""
    return saved_bytes_by_region(run, parameters, {})["total"]


def saved_bytes_by_region(run: Callable[[], object], parameters: Iterable[torch.Tensor],
                          regions: Dict[str, Iterable[torch.nn.Module]]) -> Dict[str, int]:
    """{"total": bytes the forward of `run()` saved, region: the part saved while one of its modules ran}."""
    params = {p.untyped_storage().data_ptr() for p in parameters}
    storages: Dict[str, Dict[int, int]] = {"total": {}, **{name: {} for name in regions}}
    active: List[str] = []

    def count(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and torch._C._current_autograd_node() is None:
            for name in ["total"] + active:
                storages[name][s.data_ptr()] = s.nbytes()

    def pack(t):
        count(t)
        return t

    handles = []
    for name, modules in regions.items():
        for module in modules:
            handles.append(module.register_forward_pre_hook(lambda *_, n=name: active.append(n)))
            handles.append(module.register_forward_hook(lambda *_, n=name: active.remove(n)))
    _counters.append(count)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        _counters.remove(count)
        for h in handles:
            h.remove()
    return {name: sum(found.values()) for name, found in storages.items()}
