"""SPMD layout on a (data, fsdp) device mesh: the batch is split over all devices, weights over the fsdp axis.

    --mesh N,1   data parallel (weights replicated)        --mesh 1,N   FSDP-style (ZeRO-3-like) sharding
    --mesh D,F   2D: D replicas of an F-way sharded model (hybrid sharding)
XLA's SPMD partitioner inserts the all-gathers and reduce-scatters; here we only annotate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from mega_depth.config import ConfigError

AXES = ("data", "fsdp")


def parse_mesh(spec: Optional[str], num_devices: int) -> Tuple[int, int]:
    """'D,F' -> (D, F) with D * F == num_devices; None -> all devices data parallel."""
    if spec is None:
        return num_devices, 1
    try:
        data, fsdp = (int(x) for x in spec.split(","))
    except ValueError:
        raise ConfigError(f"--mesh {spec!r}: expected DATA,FSDP (two integers, e.g. 2,4)") from None
    if data < 1 or fsdp < 1 or data * fsdp != num_devices:
        raise ConfigError(f"--mesh {spec}: DATA x FSDP must equal the {num_devices} devices present "
                          f"(e.g. --mesh {num_devices},1 for data parallel, --mesh 1,{num_devices} for FSDP)")
    return data, fsdp


@dataclass
class Layout:
    """Where tensors go. mesh is None on the eager CPU reference (one device, nothing to annotate)."""

    data: int = 1
    fsdp: int = 1
    mesh: object = None

    @property
    def batch_shards(self) -> int:
        return self.data * self.fsdp

    def shard_batch(self, t: torch.Tensor) -> torch.Tensor:
        if self.mesh is not None and self.batch_shards > 1:
            import torch_xla.distributed.spmd as xs

            xs.mark_sharding(t, self.mesh, (AXES,) + (None,) * (t.dim() - 1))
        return t

    def shard_params(self, model: torch.nn.Module) -> None:
        """Split each weight along its first dim that the fsdp axis divides; the rest stay replicated."""
        if self.mesh is None or self.fsdp == 1:
            return
        import torch_xla.distributed.spmd as xs

        for p in model.parameters():  # a tied weight is one Parameter, annotated once
            dims = [d for d in range(p.dim()) if p.shape[d] % self.fsdp == 0 and p.shape[d] >= self.fsdp]
            if dims:
                spec = tuple("fsdp" if d == dims[0] else None for d in range(p.dim()))
                xs.mark_sharding(p, self.mesh, spec)


def xla_layout(mesh_spec: Optional[str]) -> Layout:
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    data, fsdp = parse_mesh(mesh_spec, n)
    return Layout(data, fsdp, xs.Mesh(np.arange(n), (data, fsdp), AXES))
