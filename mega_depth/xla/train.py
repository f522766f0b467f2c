"""`python -m mega_depth.xla.train`: train a mega_depth model on XLA devices (TPU; the CPU PJRT device in tests).

    PJRT_DEVICE=TPU python -m mega_depth.xla.train --config launch/configs/125m-attnres.yaml --mesh 1,8 --bf16
    python -m mega_depth.xla.train --device cpu --config ...      # the same trainer, eager, no torch-xla

Same config system, data, tokenizer, initial weights (keyed by seed, like the Megatron trainer), LR schedule and
metrics.jsonl as `python -m mega_depth.train`; the model is the plain one (mega_depth/model.py) under SPMD:
`--mesh DATA,FSDP` (sharding.py). --micro-batch-size is per batch shard, as Megatron's is per data-parallel rank;
the step's loss is the mean over (micro-batch, shard) of each one's token-mean, as in the Megatron trainer.
Megatron-only options (tensor/pipeline parallelism, DeepSpeed, recomputation, the distributed optimizer) are
refused: sharding is the mesh's job here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import List, Optional

from mega_depth.config import ConfigError, parse_args

INSTALL_HINT = ("torch-xla is not installed. On a TPU VM: pip install torch==2.9.0 'torch-xla[tpu]==2.9.0' "
                "(see launch/tpu.sh); on CPU for tests: bash tools/test_xla.sh. Or run this trainer eagerly with "
                "--device cpu.")


def _parse(argv: Optional[List[str]]):
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--device", choices=("xla", "cpu"), default="xla")
    parser.add_argument("--mesh", default=None, help="DATA,FSDP device mesh (default: all devices data parallel)")
    parser.add_argument("--mat-mul-precision", choices=("default", "high", "highest"), default="default")
    own, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        print("XLA options: --device {xla,cpu}  --mesh DATA,FSDP  --mat-mul-precision {default,high,highest}\n"
              "All other flags: python -m mega_depth.train --help")
        raise SystemExit(0)
    return own, parse_args(rest)


def _refuse_megatron_only(cfg) -> None:
    p, t = cfg.parallel, cfg.training
    bad = [flag for flag, on in (
        ("--tensor-model-parallel-size", p.tensor_model_parallel_size > 1),
        ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size > 1),
        ("--num-layers-per-virtual-pipeline-stage", p.num_layers_per_virtual_pipeline_stage is not None),
        ("--sequence-parallel", p.sequence_parallel), ("--use-distributed-optimizer", p.use_distributed_optimizer),
        ("--recompute-granularity", p.recompute_granularity is not None), ("--deepspeed", t.deepspeed),
        ("--compile-mixing", cfg.residual.compile_mixing)) if on]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: Megatron-trainer options, not used by the XLA trainer; shard with "
                          "--mesh DATA,FSDP instead")


def group_mean_loss(logits, labels, loss_mask, groups: int):
    """Mean over `groups` equal slices of the batch of each slice's masked token-mean (fp32 cross entropy):
    what Megatron computes over `groups` data-parallel ranks. logits [b, s, V]; labels, loss_mask [b, s]."""
    import torch.nn.functional as F

    b, s = labels.shape
    losses = F.cross_entropy(logits.float().reshape(b * s, -1), labels.reshape(-1), reduction="none").view(b, s)
    losses, mask = losses.view(groups, b // groups, s), loss_mask.float().view(groups, b // groups, s)
    return ((losses * mask).sum((1, 2)) / mask.sum((1, 2)).clamp(min=1)).mean()


class Trainer:
    """Model, optimizer, schedule and the step function on one device set (XLA mesh or eager CPU)."""

    def __init__(self, cfg, device: str, mesh: Optional[str]):
        import torch

        from mega_depth.config import to_dict
        from mega_depth.init import init_plain_model, padded_vocab_size, seed_everything
        from mega_depth.megatron.state_dict import decoder_config
        from mega_depth.model import CausalLM
        from mega_depth.training.schedule import build_scheduler
        from mega_depth.xla.sharding import Layout, xla_layout

        self.cfg, self.xla = cfg, device == "xla"
        self.layout = xla_layout(mesh) if self.xla else Layout()
        cfg.validate(self.layout.batch_shards)
        self.num_microbatches = cfg.num_microbatches(self.layout.batch_shards)
        seed_everything(cfg.training.seed)
        self.dc = decoder_config(to_dict(cfg), padded_vocab_size(cfg.model.vocab_size))
        model = CausalLM(self.dc)
        init_plain_model(model, self.dc, cfg.training.seed, cfg.model.init_method_std)
        if self.xla:
            import torch_xla

            self.device = torch_xla.device()
        else:
            self.device = torch.device("cpu")
        self.model = model.to(self.device)
        self.model.tie_weights()
        self.layout.shard_params(self.model)
        t = cfg.training
        # Megatron's grouping: no weight decay on 1-D parameters and biases (norm gains, AttnRes queries, GRN bias).
        no_wd = [p for n, p in self.model.named_parameters() if p.dim() == 1 or n.endswith(".bias")]
        wd = [p for n, p in self.model.named_parameters() if not (p.dim() == 1 or n.endswith(".bias"))]
        self.optimizer = torch.optim.AdamW(
            [{"params": wd, "wd_mult": 1.0}, {"params": no_wd, "wd_mult": 0.0}], lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.params = [p for p in self.model.parameters()]

    def _forward_loss(self, batch):
        import torch

        tokens, labels, mask, positions = (self.layout.shard_batch(batch[k].to(self.device))
                                           for k in ("tokens", "labels", "loss_mask", "position_ids"))
        dev = "xla" if self.xla else "cpu"
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=self.cfg.training.bf16):
            logits = self.model(tokens, positions)
        return group_mean_loss(logits, labels, mask, self.layout.batch_shards)

    def step(self, microbatches) -> dict:
        """One optimizer step over a global batch (gradient accumulation over its micro-batches)."""
        import torch

        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        total = None
        for batch in microbatches:
            loss = self._forward_loss(batch) / len(microbatches)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.training.clip_grad or float("inf"))
        value = float(total.item())  # one host sync per step: the NaN policy must see the loss before the update
        if not math.isfinite(value):
            self._sync()
            if self.cfg.training.on_nan == "stop":
                raise FloatingPointError(f"loss is {value}; stopping (--on-nan stop). Resume from the last checkpoint "
                                         "with a lower --lr or --clip-grad, or use --on-nan skip")
            return {"loss": value, "grad_norm": float("nan"), "lr": lr, "skipped": True}
        self.optimizer.step()
        self.scheduler.step(increment=1)
        self._sync()
        return {"loss": value, "grad_norm": float(grad_norm.item()), "lr": lr, "skipped": False}

    def evaluate(self, sampler, iters: int) -> float:
        import torch

        self.model.eval()
        try:
            with torch.no_grad():
                losses = []
                for i in range(iters):
                    batches = sampler.microbatches(i)
                    losses.append(sum(float(self._forward_loss(b).item()) for b in batches) / len(batches))
                    self._sync()
        finally:
            self.model.train()
        return sum(losses) / len(losses)

    def _sync(self) -> None:
        if self.xla:
            import torch_xla

            torch_xla.sync()


def _datasets(cfg, trainer):
    from mega_depth.data.datasets import GlobalBatchSampler, MockTokenizer, build_datasets
    from mega_depth.data.tokenizer import SentencePieceTokenizer

    shards, nmb = trainer.layout.batch_shards, trainer.num_microbatches
    gbs = cfg.training.micro_batch_size * nmb * shards
    eval_batches = (cfg.training.train_iters // cfg.data.eval_interval + 1) * cfg.data.eval_iters \
        if cfg.data.eval_interval else 0
    tokenizer = MockTokenizer(cfg.model.vocab_size) if cfg.data.mock_data else \
        SentencePieceTokenizer(cfg.data.tokenizer_model)
    train_ds, valid_ds, _ = build_datasets(cfg, tokenizer, (cfg.training.train_iters * gbs,
                                                            eval_batches * gbs if eval_batches else None, None))
    # One SPMD program sees the whole global micro-batch: the shards' micro-batches side by side, in the order
    # Megatron's data-parallel ranks read them.
    mbs = cfg.training.micro_batch_size * shards
    sampler = GlobalBatchSampler(train_ds, mbs, nmb, 1, 0)
    valid = None
    if cfg.data.eval_interval:
        if valid_ds is None:
            raise ConfigError("--eval-interval needs a validation split: give --split with a non-zero second part")
        valid = GlobalBatchSampler(valid_ds, mbs, nmb, 1, 0)
    return sampler, valid


def train(trainer: Trainer) -> list:
    from mega_depth.xla import checkpoint

    cfg = trainer.cfg
    sampler, valid = _datasets(cfg, trainer)
    start = 0
    if cfg.checkpoint.load:
        start = checkpoint.load(trainer.model, trainer.optimizer, trainer.scheduler, cfg, cfg.checkpoint.load)
        print(f"resumed from {cfg.checkpoint.load} at step {start}", flush=True)
    out_dir = cfg.logging.output_dir
    os.makedirs(out_dir, exist_ok=True)
    writer = _tensorboard(cfg)
    layout = {"devices": trainer.layout.batch_shards, "mesh": [trainer.layout.data, trainer.layout.fsdp],
              "device": "xla" if trainer.xla else "cpu"}
    tokens_per_step = sampler.global_batch_size * cfg.model.seq_length
    history, train_time = [], 0.0
    for step in range(start, cfg.training.train_iters):
        t0 = time.perf_counter()
        result = trainer.step(sampler.microbatches(step))
        elapsed = time.perf_counter() - t0
        train_time += elapsed
        done = step + 1
        record = {"step": done, "loss": result["loss"], "lr": result["lr"], "grad_norm": result["grad_norm"],
                  "tokens_per_s": tokens_per_step / elapsed, "tokens": done * tokens_per_step,
                  "train_time_s": train_time}
        if result["skipped"]:
            record["skipped"] = True
        if valid is not None and done % cfg.data.eval_interval == 0:
            record["val_loss"] = trainer.evaluate(valid, cfg.data.eval_iters)
            record["val_ppl"] = math.exp(min(record["val_loss"], 50.0))
        history.append(record)
        with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
                if key in record:
                    writer.add_scalar(f"train/{key}", record[key], done)
        if done % cfg.logging.log_interval == 0 or "val_loss" in record or result["skipped"]:
            line = (f"step {done:>6} | loss {record['loss']:.6f} | lr {record['lr']:.3e} | "
                    f"grad norm {record['grad_norm']:.4f} | {record['tokens_per_s']:.0f} tokens/s")
            if "val_loss" in record:
                line += f" | val loss {record['val_loss']:.4f} | val ppl {record['val_ppl']:.2f}"
            print(line + (" | skipped (non-finite loss)" if result["skipped"] else ""), flush=True)
        ck = cfg.checkpoint
        periodic = ck.save and ck.save_interval and done % ck.save_interval == 0
        exiting = cfg.training.exit_interval and done % cfg.training.exit_interval == 0
        if ck.save and (periodic or exiting or done == cfg.training.train_iters):
            path = checkpoint.save(trainer.model, trainer.optimizer, trainer.scheduler, cfg, done, ck.save, layout)
            print(f"saved checkpoint {path}", flush=True)
        if exiting:
            print(f"exiting after step {done} (--exit-interval)", flush=True)
            break
    if writer is not None:
        writer.close()
    return history


def _tensorboard(cfg):
    if not cfg.logging.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the XLA test environment has no tensorboard; metrics.jsonl has everything
        return None
    return SummaryWriter(os.path.join(cfg.logging.output_dir, "tensorboard"))


def main(argv: Optional[List[str]] = None) -> int:
    try:
        own, cfg = _parse(argv)
        _refuse_megatron_only(cfg)
        from mega_depth.train import _apply_tokenizer_vocab

        _apply_tokenizer_vocab(cfg)
    except ConfigError as e:
        print(f"mega_depth.xla: configuration error: {e}", file=sys.stderr)
        return 2
    if own.device == "xla":
        try:
            import torch_xla  # noqa: F401
            import torch_xla.runtime as xr
        except ImportError:
            print(f"mega_depth.xla: {INSTALL_HINT}", file=sys.stderr)
            return 2
        xr.use_spmd()  # before any tensor reaches the device
        if os.environ.get("MEGA_DEPTH_XLA_CACHE"):
            xr.initialize_cache(os.environ["MEGA_DEPTH_XLA_CACHE"], readonly=False)
        if xr.process_count() > 1 and cfg.checkpoint.save:
            print("mega_depth.xla: configuration error: --save on a multi-host pod is not supported yet (checkpoints "
                  "gather full tensors on one host); train without --save there, or on a single host",
                  file=sys.stderr)
            return 2
        if own.mat_mul_precision != "default":
            import torch_xla.backends

            torch_xla.backends.set_mat_mul_precision(own.mat_mul_precision)
    elif own.mesh is not None:
        print("mega_depth.xla: configuration error: --mesh needs --device xla", file=sys.stderr)
        return 2
    try:
        trainer = Trainer(cfg, own.device, own.mesh)
        train(trainer)
    except ConfigError as e:
        print(f"mega_depth.xla: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"mega_depth.xla: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
