"""Process-group, model, optimizer and scheduler set-up around megatron-core."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import List

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from mega_depth import mixing
from mega_depth.config import Config
from mega_depth.init import seed_everything
from mega_depth.training.schedule import build_scheduler
from mega_depth.megatron import cpu_compat
from mega_depth.megatron.builder import build_model_chunks


def init_distributed() -> int:
    """Start the default process group (NCCL on GPU, gloo on CPU); works under torchrun and as one process."""
    cpu_compat.apply()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10))
    return torch.distributed.get_world_size()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TrainState:
    cfg: Config
    model: List[torch.nn.Module]  # DDP-wrapped chunks, one per virtual stage
    optimizer: object
    scheduler: object  # megatron.core OptimizerParamScheduler (training/schedule.py)
    num_microbatches: int


def setup(cfg: Config) -> TrainState:
    """Parallel groups, model chunks (DDP), Megatron optimizer (AdamW, optionally distributed) and LR schedule."""
    world = torch.distributed.get_world_size()
    p, t = cfg.parallel, cfg.training
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_size,
    )
    seed_everything(t.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
    mixing.compile_kernels(cfg.residual.compile_mixing)
    chunks = build_model_chunks(cfg)
    if torch.cuda.is_available():
        for c in chunks:
            c.cuda(torch.cuda.current_device())
    tconfig = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=p.use_distributed_optimizer,
    )
    model = [
        DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=c, disable_bucketing=(i > 0))
        for i, c in enumerate(chunks)
    ]
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=t.bf16,
        params_dtype=torch.bfloat16 if t.bf16 else torch.float32,
        use_distributed_optimizer=p.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    scheduler = build_scheduler(cfg, optimizer)
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.grad_scale_func = optimizer.scale_loss
    tconfig.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    if len(model) > 1:
        tconfig.grad_sync_func = [m.start_grad_sync for m in model]
    return TrainState(cfg, model, optimizer, scheduler, cfg.num_microbatches(world))


