"""The training step and loop: Megatron's pipeline schedules, metrics.jsonl, a readable line per step."""

from __future__ import annotations

import json
import os
import time
from functools import partial
from typing import Dict, List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from mega_depth.data.datasets import GlobalBatchSampler
from mega_depth.megatron import providers
from mega_depth.training.setup import TrainState


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of one micro-batch ([b, s] per-token losses from GPTModel)."""
    losses = output_tensor.float()
    mask = loss_mask.float()
    loss = (losses * mask).sum() / mask.sum().clamp(min=1)
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"],
    )
    return output, partial(_loss_func, batch["loss_mask"])


def _to_device(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    if torch.cuda.is_available():
        return {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    return batch


def train_step(state: TrainState, microbatches: List[dict]) -> dict:
    """One optimizer step over a global batch. Returns loss (averaged over micro-batches and DP), grad norm, lr."""
    cfg = state.cfg
    for m in state.model:
        m.zero_grad_buffer()
    state.optimizer.zero_grad()
    providers.clear_stashes()
    providers.HOP_COUNTER.reset()
    batches = [_to_device(b) for b in microbatches]
    iterators = [iter(batches) for _ in state.model]
    forward_backward = get_forward_backward_func()
    losses = forward_backward(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=state.model if len(state.model) > 1 else state.model[0],
        num_microbatches=state.num_microbatches,
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.training.micro_batch_size,
        forward_only=False,
    )
    update_ok, grad_norm, _ = state.optimizer.step()
    if update_ok:
        state.scheduler.step(increment=1)
    return {
        "loss": reduce_loss(losses),
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "lr": state.optimizer.param_groups[0]["lr"],
        "skipped": not update_ok,
    }


def reduce_loss(losses: List[dict]) -> float:
    """The step's mean loss, on every rank: averaged over micro-batches on the last stage, then over DP."""
    is_reporter = parallel_state.is_pipeline_last_stage(ignore_virtual=True) and \
        parallel_state.get_tensor_model_parallel_rank() == 0
    value = torch.zeros(1, dtype=torch.float64)
    if is_reporter and losses:
        value[0] = torch.stack([l["lm loss"].double().cpu() for l in losses]).mean()
    value = value.to(_device())
    torch.distributed.all_reduce(value)
    return float(value.item()) / parallel_state.get_data_parallel_world_size()


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def train(state: TrainState, sampler: GlobalBatchSampler, start_step: int = 0,
          on_step: Optional[callable] = None) -> List[dict]:
    cfg = state.cfg
    rank = torch.distributed.get_rank()
    out_dir = cfg.training.output_dir
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    history = []
    tokens_per_step = sampler.global_batch_size * cfg.model.seq_length
    for step in range(start_step, cfg.training.train_iters):
        t0 = time.perf_counter()
        result = train_step(state, sampler.microbatches(step))
        elapsed = time.perf_counter() - t0
        record = {
            "step": step + 1,
            "loss": result["loss"],
            "lr": result["lr"],
            "grad_norm": result["grad_norm"],
            "tokens_per_s": tokens_per_step / elapsed,
        }
        history.append(record)
        if on_step is not None:
            on_step(step + 1)
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if (step + 1) % cfg.training.log_interval == 0:
                print(f"step {step + 1:>6} | loss {record['loss']:.6f} | lr {record['lr']:.3e} | "
                      f"grad norm {record['grad_norm']:.4f} | {record['tokens_per_s']:.0f} tokens/s", flush=True)
    return history
