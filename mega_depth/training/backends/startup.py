"""Megatron's start-up and shut-down, written once for every backend that builds Megatron-core's model (the Megatron
and DeepSpeed backends): the CPU compatibility layer, the default process group, Megatron's process groups (TP x CP x
PP x DP, with expert parallelism carved out of DP and expert TP), and the seeds; at the end, those groups freed."""

from __future__ import annotations

from typing import FrozenSet

import torch

from mega_depth.config import Config
from mega_depth.init import seed_everything
from mega_depth.megatron import cpu_compat, te_absent
from mega_depth.training.distributed import init_process_group


def _process_groups() -> FrozenSet:
    """The process groups this process holds (c10d keeps no public list of them)."""
    from torch.distributed import distributed_c10d

    return frozenset(distributed_c10d._world.pg_map)


def start_megatron(cfg: Config, data_parallel_only: bool = False) -> FrozenSet:
    """Collective. `data_parallel_only`: every rank holds the whole model (DeepSpeed's ZeRO data parallelism).
    Returns the process groups Megatron made, for `stop_megatron`."""
    from megatron.core import parallel_state, tensor_parallel

    cpu_compat.apply()  # Megatron starts here: its CUDA assumptions redirected on a CPU-only machine
    te_absent.apply()  # and the names its MoE code reads without Transformer Engine
    init_process_group()  # torchrun, the deepspeed launcher, or one plain process (no MPI discovery)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    groups_before = _process_groups()
    p = cfg.parallel
    if data_parallel_only:
        parallel_state.initialize_model_parallel(1, 1)
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_size,
            context_parallel_size=p.context_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        )
    # one stream a pipeline stage, as Megatron-LM seeds (seed + 100 x stage): with the same seed every stage would
    # repeat the first stage's dropout masks. The weights do not draw from these (keyed init: mega_depth/init.py).
    seed = cfg.training.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    seed_everything(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return _process_groups() - groups_before


def stop_megatron(megatron_groups: FrozenSet) -> None:
    """Collective: Megatron's parallel state forgotten and its process groups (`start_megatron`'s) destroyed. Megatron's
    own `destroy_model_parallel` frees only its gloo side groups: each other group keeps its threads and sockets (a
    gloo group on a CPU, a NCCL communicator on a GPU), so a process that builds one backend after another (a sweep,
    a benchmark of every mechanism) slowed down with each: ~2,700 threads a rank after 40 builds."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    parallel_state.destroy_model_parallel()
    for group in megatron_groups & _process_groups():  # those destroy_model_parallel left
        torch.distributed.destroy_process_group(group)
    # A destroyed gloo group's threads end when the group object goes, and Megatron's RotaryEmbedding.forward is an
    # lru_cache over `self` (class-wide, 32 entries): it kept each closed model's rotary module, and with it the CP
    # group, alive (3 threads a build).
    RotaryEmbedding.forward.cache_clear()
