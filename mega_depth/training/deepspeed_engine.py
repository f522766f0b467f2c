"""`--deepspeed --deepspeed-config ds.json`: train the Megatron-core model with the DeepSpeed engine (ZeRO 0-3
for data parallelism). Launch with the `deepspeed` launcher (launch/deepspeed.sh) or torchrun.

Scope: data parallelism only. DeepSpeed's engine owns the optimizer, ZeRO partitioning, gradient accumulation
and clipping; Megatron's pipeline schedules and tensor parallelism stay on the Megatron path (config.validate
refuses --deepspeed with PP > 1 or TP > 1, with the reason). mega_depth sets the batch keys of the DeepSpeed
config from its own flags so the two can never disagree.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch

from mega_depth.config import Config, ConfigError


class _MegatronMPU:
    """The `mpu` interface DeepSpeed asks for, answered by megatron-core's parallel_state."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.ps = ps

    def get_model_parallel_rank(self):
        return self.ps.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self):
        return self.ps.get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return self.ps.get_tensor_model_parallel_group()

    def get_data_parallel_rank(self):
        return self.ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self):
        return self.ps.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return self.ps.get_data_parallel_group()


def _ds_config(cfg: Config, dp: int, num_microbatches: int) -> dict:
    path = cfg.training.deepspeed_config
    try:
        with open(path) as f:
            ds = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed-config {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed-config {path} is not valid JSON: {e}") from None
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, not {stage!r}")
    t = cfg.training
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    ds["gradient_accumulation_steps"] = num_microbatches
    ds["train_batch_size"] = t.micro_batch_size * num_microbatches * dp
    ds["gradient_clipping"] = t.clip_grad
    ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    ds["optimizer"]["params"].update({"lr": t.lr, "betas": [t.adam_beta1, t.adam_beta2], "eps": t.adam_eps,
                                      "weight_decay": t.weight_decay})
    if not torch.cuda.is_available():
        ds["optimizer"]["params"].setdefault("torch_adam", True)  # CPU: no 100 s JIT build of fused Adam
    if t.bf16:
        ds["bf16"] = {"enabled": True}
    return ds


def run(cfg: Config) -> int:
    if cfg.parallel.tensor_model_parallel_size != 1:
        raise ConfigError("--deepspeed trains with data parallelism (ZeRO); use the Megatron path (no --deepspeed) "
                          "for tensor or pipeline parallelism")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    import deepspeed
    from megatron.core import parallel_state, tensor_parallel

    from mega_depth.data.datasets import GlobalBatchSampler, MockTokenizer, build_datasets
    from mega_depth.data.tokenizer import SentencePieceTokenizer
    from mega_depth.megatron import cpu_compat
    from mega_depth.megatron.builder import build_model_chunks
    from mega_depth.init import seed_everything
    from mega_depth.training.schedule import build_scheduler

    cpu_compat.apply()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    world = torch.distributed.get_world_size()
    parallel_state.initialize_model_parallel(1, 1)
    seed_everything(cfg.training.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.training.seed)
    (model,) = build_model_chunks(cfg)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    nmb = cfg.num_microbatches(world)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=_ds_config(cfg, dp, nmb), mpu=_MegatronMPU())
    scheduler = build_scheduler(cfg, optimizer)
    gbs = cfg.training.micro_batch_size * nmb * dp
    tokenizer = MockTokenizer(cfg.model.vocab_size) if cfg.data.mock_data else \
        SentencePieceTokenizer(cfg.data.tokenizer_model)
    train_ds = build_datasets(cfg, tokenizer, (cfg.training.train_iters * gbs, None, None))[0]
    sampler = GlobalBatchSampler(train_ds, cfg.training.micro_batch_size, nmb, dp, dp_rank)

    start = 0
    if cfg.checkpoint.load:
        _, client = engine.load_checkpoint(cfg.checkpoint.load)
        if client is None:
            raise ConfigError(f"--load {cfg.checkpoint.load} holds no DeepSpeed checkpoint")
        start = client["step"]
        scheduler.load_state_dict(client["scheduler"])
    rank = torch.distributed.get_rank()
    out_dir = cfg.logging.output_dir
    os.makedirs(out_dir, exist_ok=True)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    for step in range(start, cfg.training.train_iters):
        t0 = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        losses = []
        for batch in sampler.microbatches(step):
            batch = {k: v.to(device) for k, v in batch.items()}
            per_token = engine(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
            mask = batch["loss_mask"].float()
            loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1)
            engine.backward(loss)
            engine.step()  # DeepSpeed updates on the gradient-accumulation boundary only
            losses.append(loss.detach())
        scheduler.step(increment=1)
        mean = torch.stack(losses).mean().reshape(1)
        torch.distributed.all_reduce(mean)
        record = {"step": step + 1, "loss": float(mean) / dp, "lr": lr,
                  "grad_norm": float(engine.get_global_grad_norm() or float("nan")),
                  "tokens_per_s": gbs * cfg.model.seq_length / (time.perf_counter() - t0)}
        if not math.isfinite(record["loss"]) and cfg.training.on_nan == "stop":
            raise RuntimeError(f"loss is {record['loss']} at step {step + 1}; stopping (--on-nan stop)")
        if rank == 0:
            with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"step {step + 1:>6} | loss {record['loss']:.6f} | lr {record['lr']:.3e} | "
                  f"{record['tokens_per_s']:.0f} tokens/s (deepspeed)", flush=True)
        ck = cfg.checkpoint
        done = step + 1
        if ck.save and ((ck.save_interval and done % ck.save_interval == 0) or done == cfg.training.train_iters):
            engine.save_checkpoint(ck.save, tag=f"iter_{done:07d}",
                                   client_state={"step": done, "scheduler": scheduler.state_dict()})
        if cfg.training.exit_interval and done % cfg.training.exit_interval == 0:
            break
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0
