"""The training step and loop: Megatron's pipeline schedules, evaluation, checkpoints, SIGTERM and NaN handling."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from functools import partial
from typing import Dict, List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from mega_depth.data.datasets import GlobalBatchSampler
from mega_depth.megatron import providers
from mega_depth.training.setup import TrainState


class NonFiniteLoss(RuntimeError):
    pass


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of one micro-batch ([b, s] per-token losses from GPTModel)."""
    losses = output_tensor.float()
    mask = loss_mask.float()
    loss = (losses * mask).sum() / mask.sum().clamp(min=1)
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _to_device(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    if torch.cuda.is_available():
        return {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    return batch


def _run_schedule(state: TrainState, microbatches: List[dict], forward_only: bool) -> float:
    providers.clear_stashes()
    providers.HOP_COUNTER.reset()
    batches = [_to_device(b) for b in microbatches]
    iterators = [iter(batches) for _ in state.model]
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=state.model if len(state.model) > 1 else state.model[0],
        num_microbatches=len(microbatches),
        seq_length=state.cfg.model.seq_length,
        micro_batch_size=state.cfg.training.micro_batch_size,
        forward_only=forward_only,
    )
    return reduce_loss(losses)


def train_step(state: TrainState, microbatches: List[dict], step: Optional[int] = None) -> dict:
    """One optimizer step over a global batch. A non-finite loss skips the update or raises (--on-nan)."""
    for m in state.model:
        m.zero_grad_buffer()
    state.optimizer.zero_grad()
    lr = state.optimizer.param_groups[0]["lr"]  # the rate this step applies (the scheduler moves it afterwards)
    loss = _run_schedule(state, microbatches, forward_only=False)
    if os.environ.get("MEGA_DEPTH_FAULT_NAN_AT_STEP") == str(step):  # fault injection for the NaN tests
        loss = float("nan")
    if not math.isfinite(loss):
        if state.cfg.training.on_nan == "stop":
            raise NonFiniteLoss(f"loss is {loss} at step {step}; stopping (--on-nan stop). Resume from the last "
                                "checkpoint with a lower --lr or --clip-grad, or use --on-nan skip")
        return {"loss": loss, "grad_norm": float("nan"), "lr": lr, "skipped": True}
    update_ok, grad_norm, _ = state.optimizer.step()
    if update_ok:
        state.scheduler.step(increment=1)
    return {
        "loss": loss,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "lr": lr,
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


def evaluate(state: TrainState, sampler: GlobalBatchSampler, iters: int) -> float:
    for m in state.model:
        m.eval()
    try:
        with torch.no_grad():
            losses = [_run_schedule(state, sampler.microbatches(i), forward_only=True) for i in range(iters)]
    finally:
        for m in state.model:
            m.train()
    return sum(losses) / len(losses)


def _log_heatmap(state: TrainState, sampler: GlobalBatchSampler, step: int, logger) -> None:
    """Collective: a forward-only probe on this step's micro-batches records the depth weights."""
    from mega_depth.training.depth_weights import collect

    for m in state.model:
        m.eval()
    try:
        with torch.no_grad():
            rows = collect(state, sampler.microbatches(step),
                           lambda st, mbs: _run_schedule(st, mbs, forward_only=True))
    finally:
        for m in state.model:
            m.train()
    if rows and logger is not None:
        path = logger.heatmap(rows, step + 1)
        print(f"depth-weight heatmap: {path}", flush=True)


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


class _Preemption:
    """SIGTERM (a scheduler's preemption notice) sets a flag; the loop saves and exits at the next step end."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # every rank stops at the same step
        return bool(flag.item())

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


def train(state: TrainState, sampler: GlobalBatchSampler, start_step: int = 0, valid_sampler=None,
          logger=None) -> List[dict]:
    """Train from `start_step` to --train-iters; evaluate, save, log. Returns the per-step records."""
    from mega_depth.training import checkpoint

    cfg = state.cfg
    rank = torch.distributed.get_rank()
    out_dir = cfg.logging.output_dir
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    history = []
    tokens_per_step = sampler.global_batch_size * cfg.model.seq_length
    preemption = _Preemption()
    ck = cfg.checkpoint
    train_time = 0.0  # seconds spent in training steps since this launch (no eval, no checkpoints)
    try:
        for step in range(start_step, cfg.training.train_iters):
            t0 = time.perf_counter()
            result = train_step(state, sampler.microbatches(step), step + 1)
            elapsed = time.perf_counter() - t0
            train_time += elapsed
            record = {"step": step + 1, "loss": result["loss"], "lr": result["lr"], "grad_norm": result["grad_norm"],
                      "tokens_per_s": tokens_per_step / elapsed, "tokens": (step + 1) * tokens_per_step,
                      "train_time_s": train_time}
            if result["skipped"]:
                record["skipped"] = True
            done = step + 1
            if valid_sampler is not None and cfg.data.eval_interval and done % cfg.data.eval_interval == 0:
                record["val_loss"] = evaluate(state, valid_sampler, cfg.data.eval_iters)
                record["val_ppl"] = math.exp(min(record["val_loss"], 50.0))
            history.append(record)
            if rank == 0:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                if done % cfg.logging.log_interval == 0 or "val_loss" in record or result["skipped"]:
                    line = (f"step {done:>6} | loss {record['loss']:.6f} | lr {record['lr']:.3e} | "
                            f"grad norm {record['grad_norm']:.4f} | {record['tokens_per_s']:.0f} tokens/s")
                    if "val_loss" in record:
                        line += f" | val loss {record['val_loss']:.4f} | val ppl {record['val_ppl']:.2f}"
                    print(line + (" | skipped (non-finite loss)" if result["skipped"] else ""), flush=True)
            if logger is not None:
                logger.step(record, _memory_gb(), state)
            last = done == cfg.training.train_iters
            every = cfg.logging.heatmap_interval
            if cfg.residual.residual != "standard" and ((every and done % every == 0) or (last and not every)):
                _log_heatmap(state, sampler, step, logger)
            preempted = preemption.agreed()
            periodic = ck.save and ck.save_interval and done % ck.save_interval == 0
            exiting = preempted or (cfg.training.exit_interval and done % cfg.training.exit_interval == 0)
            if ck.save and (periodic or exiting or done == cfg.training.train_iters):
                path = checkpoint.save(state, done, ck.save)
                if rank == 0:
                    print(f"saved checkpoint {path}", flush=True)
            if exiting:
                if rank == 0:
                    print(f"exiting after step {done} ({'SIGTERM' if preempted else '--exit-interval'})", flush=True)
                break
    finally:
        preemption.restore()
    return history
