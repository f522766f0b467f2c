"""Host-device synchronisations in a training step: the ones it means to make, and a CPU check for the others.

A sync (the host waiting for the GPU) drains the GPU's queue: the GPU then idles while the host launches the next
kernels. A step should make exactly one, where it reads its loss for logging and the NaN policy; the backends mark
that read with `intended(...)`.

On a GPU, `torch.cuda.set_sync_debug_mode("error")` around a step finds the rest (tools/device_check.sh does);
`intended` lifts the mode for its block. On a CPU, `SyncDetector` finds the calls that would sync on a GPU, made
from mega_depth's own code: reading a value to the host (item, tolist, cpu, numpy, nonzero, bool/int/float of a
tensor), building a tensor from Python data directly on a device (a blocking copy from pageable memory), a
blocking host-to-device `.to` and torch.cuda.synchronize. It patches those functions while active and records each
call with its caller; calls inside `intended` blocks are not recorded.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from typing import Iterator, List, Sequence

import torch

_STATE = threading.local()


def _intended_depth() -> int:
    return getattr(_STATE, "intended", 0)


@contextlib.contextmanager
def intended(reason: str) -> Iterator[None]:
    """A sync the step means to make (reason: what it reads). Lifts torch.cuda's sync debug mode for the block."""
    _STATE.intended = _intended_depth() + 1
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)
        _STATE.intended -= 1


@dataclass(frozen=True)
class Sync:
    what: str
    where: str  # file:line of the mega_depth frame that made the call

    def __str__(self) -> str:
        return f"{self.what} at {self.where}"


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Megatron's CPU patches run only without CUDA (their syncs do not exist on a GPU)
CPU_ONLY = (os.path.join(PACKAGE, "megatron", "cpu_compat.py"),)


def _has_device_target(args, kwargs) -> bool:
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str)) or (isinstance(a, int) and not isinstance(a, bool))
               for a in args)


class SyncDetector:
    """with SyncDetector() as found: ...  -> found: the syncs made by code under `paths` (default: mega_depth's own;
    a sync that torch or Megatron makes internally is theirs; the CPU-only patches are left out), as a list of
    Sync."""

    READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__")

    def __init__(self, paths: Sequence[str] = (PACKAGE,), exclude: Sequence[str] = CPU_ONLY):
        self.paths = tuple(os.path.abspath(p) + os.sep for p in paths)
        self.exclude = tuple(os.path.abspath(p) for p in exclude)
        self.found: List[Sync] = []
        self._patches = []

    def _record(self, what: str) -> None:
        if _intended_depth():
            return
        frame = sys._getframe(2)  # 0: here, 1: the patched function, 2: its caller
        name = os.path.abspath(frame.f_code.co_filename)
        if name.startswith(self.paths) and name not in self.exclude:
            self.found.append(Sync(what, f"{frame.f_code.co_filename}:{frame.f_lineno}"))

    def _patch(self, owner, name, wrapper) -> None:
        original = getattr(owner, name)
        self._patches.append((owner, name, original))
        setattr(owner, name, wrapper(original))

    def __enter__(self) -> List[Sync]:
        detector = self

        def read(name):
            def wrap(original):
                def method(self, *args, **kwargs):
                    detector._record(f"Tensor.{name}()")
                    return original(self, *args, **kwargs)
                return method
            return wrap

        def factory(name):
            def wrap(original):
                def build(data, *args, **kwargs):
                    if "device" in kwargs and not isinstance(data, torch.Tensor):
                        detector._record(f"torch.{name}(<python data>, device=...): a blocking copy")
                    return original(data, *args, **kwargs)
                return build
            return wrap

        def to(original):
            def method(self, *args, **kwargs):
                if self.device.type == "cpu" and _has_device_target(args, kwargs) and not kwargs.get("non_blocking"):
                    detector._record("Tensor.to(device) without non_blocking=True: a blocking copy")
                return original(self, *args, **kwargs)
            return method

        def synchronize(original):
            def call(*args, **kwargs):
                detector._record("torch.cuda.synchronize()")
                return original(*args, **kwargs)
            return call

        for name in self.READS:
            self._patch(torch.Tensor, name, read(name))
        for name in ("tensor", "as_tensor"):
            self._patch(torch, name, factory(name))
        self._patch(torch.Tensor, "to", to)
        self._patch(torch.cuda, "synchronize", synchronize)
        return self.found

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()
