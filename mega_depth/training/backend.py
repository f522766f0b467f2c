"""What the one training loop (trainer.py) needs from a backend: Megatron-core (backends/megatron.py), DeepSpeed
(backends/deepspeed.py) and the plain decoder on torch-xla or the CPU (xla/backend.py) each supply it."""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Tuple, runtime_checkable

import torch


@runtime_checkable
class Backend(Protocol):
    format: str  # its checkpoint format: "megatron", "deepspeed", "plain"
    rank: int
    world_size: int

    # --- collectives (one process: trivial) ---
    def barrier(self) -> None: ...

    def broadcast(self, obj): ...  # rank 0's obj on every rank

    def any(self, flag: bool) -> bool: ...  # logical or over ranks

    def gather(self, obj) -> list: ...  # every rank's obj

    # --- shape and start ---
    @property
    def sampler_shape(self) -> Tuple[int, int, int, int]: ...  # (mbs, micro-batches, dp, dp_rank): how it reads

    def build(self, initial_weights: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Model, optimizer, schedule. initial_weights: a full Megatron state dict (weights-only checkpoint)."""

    def layout(self) -> dict: ...

    def parameters_on_rank(self) -> int: ...

    def peak_flops(self) -> Optional[float]: ...  # one device's bf16 peak, or None

    def memory_gb(self) -> float: ...

    # --- a step ---
    @property
    def lr(self) -> float: ...

    def forward_backward(self, microbatches: List[dict], poison: bool = False) -> float:
        """The step's mean loss, the same on every rank; grads accumulated (poison: the NaN fault injection)."""

    def update(self) -> Tuple[float, bool]: ...  # apply the accumulated update: (grad norm, applied)

    def discard(self) -> None: ...  # skip it: weights, optimizer state and schedule stay as they are

    def evaluate(self, microbatches: List[dict]) -> float: ...

    def heatmap_figures(self, microbatches: List[dict]) -> Optional[dict]: ...  # on rank 0, else None

    def moe_metrics(self) -> Optional[dict]:
        """Collective: tokens per expert and load-balancing loss per MoE layer since the last call; None: dense."""

    # --- checkpoints ---
    def save_files(self, tmp_dir: str, step: int) -> None: ...

    def load(self, ckpt_dir: str, meta: dict) -> int: ...  # the step it resumes after

    def close(self) -> None: ...
