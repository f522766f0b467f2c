"""Megatron's start-up, written once for every backend that builds Megatron-core's model (the Megatron and DeepSpeed
backends): the CPU compatibility layer, the default process group, Megatron's process groups (TP x CP x PP x DP,
with expert parallelism carved out of DP and expert TP), and the seeds."""

from __future__ import annotations

from mega_depth.config import Config
from mega_depth.init import seed_everything
from mega_depth.megatron import cpu_compat, te_absent
from mega_depth.training.distributed import init_process_group


def start_megatron(cfg: Config, data_parallel_only: bool = False) -> None:
    """Collective. `data_parallel_only`: every rank holds the whole model (DeepSpeed's ZeRO data parallelism)."""
    from megatron.core import parallel_state, tensor_parallel

    cpu_compat.apply()  # Megatron starts here: its CUDA assumptions redirected on a CPU-only machine
    te_absent.apply()  # and the names its MoE code reads without Transformer Engine
    init_process_group()  # torchrun, the deepspeed launcher, or one plain process (no MPI discovery)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
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
    seed_everything(cfg.training.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.training.seed)
