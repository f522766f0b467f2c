"""Activation memory as autograd sees it: the bytes a forward saves for backward, on any device.

Counted with torch.autograd.graph.saved_tensors_hooks over unique storages, parameters excluded. Only what the
forward saves: it stays alive until its backward, so storages are unique by address. What a recomputing Function
saves again inside backward is transient (one region at a time) and is not counted. The figure does not depend on
the machine (a GPU keeps the same tensors), so a CPU run shows the fused paths' memory contract too.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def saved_for_backward_bytes(run: Callable[[], object], parameters: Iterable[torch.Tensor]) -> int:
    """Run `run()` (a forward, or a forward and its backward) and return the bytes its forward saved."""
    params = {p.untyped_storage().data_ptr() for p in parameters}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and torch._C._current_autograd_node() is None:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())
