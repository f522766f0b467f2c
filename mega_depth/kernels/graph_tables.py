"""Pointer tables while a training step is captured as a CUDA graph (`--cuda-graph-impl local`,
mega_depth/megatron/step_graph.py).

Eagerly, `common.pointer_table` copies each table from pinned host memory to the device, and keeps it by its
pointers. Under capture that copy would become a graph node that reads the pinned block at every replay, long after
the host allocator has handed the block to another tensor; and the host allocator queries CUDA events to recycle
blocks, which a capture forbids. So a captured step's tables are slices of one device buffer, reserved before the
capture (sized by the tables of the step before it) and filled by one plain copy after it: the graph only reads
them. A table holds exactly the pointers it was made with, and a replay reuses the capture's addresses, so the
tables stay right for every replay.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence

import torch
from torch import Tensor

ALIGN = 2  # entries: each table starts on a 16-byte boundary, as an allocated table does (Triton specialises
# a pointer argument on its 16-byte alignment: a table at another offset would compile another kernel mid-capture)


class Counter:
    """Table entries made since the last reset (a padded upper bound): what a capture of the same step needs."""

    entries = 0


def counted(pointers: int) -> None:
    Counter.entries += pointers + ALIGN - 1


class CapturedTables:
    """One device buffer of int64 pointers; `take` hands out a table, `fill` writes them all after the capture."""

    def __init__(self, device: torch.device, entries: int):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as a tensor's device reads: cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = torch.empty(max(entries, ALIGN), dtype=torch.int64, device=self.device)
        self.pointers: List[int] = []

    def take(self, pointers: Sequence[int], device: torch.device) -> Tensor:
        if device != self.device:
            raise RuntimeError(f"a pointer table for {device} while the step on {self.device} is being captured")
        start = -(-len(self.pointers) // ALIGN) * ALIGN
        end = start + len(pointers)
        if end > self.buffer.numel():
            raise RuntimeError(f"the captured step made more pointer-table entries ({end}) than the step before it "
                               f"({self.buffer.numel()}): a step must launch the same kernels every time it runs; "
                               "run without --cuda-graph-impl, and report the mechanism")
        self.pointers.extend([0] * (start - len(self.pointers)) + list(pointers))
        return self.buffer[start:end]

    def fill(self) -> None:
        """After the capture, outside it: the graph's reads find the pointers from the first replay on."""
        if self.pointers:
            self.buffer[:len(self.pointers)].copy_(torch.tensor(self.pointers, dtype=torch.int64))


ACTIVE: Optional[CapturedTables] = None  # while a capture runs: where pointer_table takes its tables


@contextlib.contextmanager
def capturing(tables: CapturedTables) -> Iterator[CapturedTables]:
    """pointer_table hands out slices of `tables` inside; fill them once the capture has ended."""
    global ACTIVE
    previous, ACTIVE = ACTIVE, tables
    try:
        yield tables
    finally:
        ACTIVE = previous
