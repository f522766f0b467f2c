"""The default process group and the collectives the trainer needs, for the backends that use torch.distributed."""

from __future__ import annotations

import datetime
import os

import torch

from mega_depth.config import ConfigError
from mega_depth.ports import PortRangeError, free_port


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def to_device(batch: dict) -> dict:
    """A micro-batch's host tensors on this rank's device without a host sync: through pinned memory on a GPU (a
    non_blocking copy from pageable memory would wait for the GPU's queue)."""
    dev = device()
    if dev.type == "cpu":
        return dict(batch)
    return {k: v.pin_memory().to(dev, non_blocking=True) for k, v in batch.items()}


def init_process_group() -> int:
    """NCCL on GPU, gloo on CPU; works under torchrun / the deepspeed launcher and as one plain process."""
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # (a launcher's port is kept, and no port drawn beside it)
            try:
                os.environ["MASTER_PORT"] = str(free_port())
            except PortRangeError as error:
                raise ConfigError(str(error)) from None
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo",
                                             timeout=datetime.timedelta(minutes=10))
    return torch.distributed.get_world_size()


class Collectives:
    """rank, barrier, broadcast (from rank 0) and any (logical or over ranks) on the default group."""

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank()

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size()

    def barrier(self) -> None:
        torch.distributed.barrier()

    def broadcast(self, obj):
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def gather(self, obj) -> list:
        gathered = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    def peak_flops(self):
        """The bf16 peak of this rank's GPU (None on a CPU or an unlisted device: no MFU)."""
        from mega_depth.training.flops import peak_flops

        return peak_flops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None

    def memory_gb(self) -> float:
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**30
        import psutil

        return psutil.Process().memory_info().rss / 2**30

    def gather_figures(self, figures):
        """Depth-weight figures of every rank, merged on rank 0 (None elsewhere)."""
        gathered = self.gather(figures)
        if self.rank != 0:
            return None
        merged = {}
        for part in gathered:
            for name, rows in (part or {}).items():
                merged.setdefault(name, {}).update(rows)
        return merged
