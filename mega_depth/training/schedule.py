"""The learning-rate / weight-decay schedule: Megatron's OptimizerParamScheduler over any optimizer's param groups
(the Megatron optimizer, or a plain torch one on the XLA path). Only `lr_mult` / `wd_mult` of a group are read."""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from mega_depth.config import Config, ConfigError


def build_scheduler(cfg: Config, optimizer) -> OptimizerParamScheduler:
    """Megatron's scheduler: linear warm-up, then constant / linear / cosine / inverse-square-root / WSD decay."""
    t = cfg.training
    decay_iters = t.lr_decay_iters or t.train_iters
    wsd = t.lr_wsd_decay_iters if t.lr_wsd_decay_iters is not None else max(1, decay_iters // 10)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters,
        lr_decay_steps=max(1, decay_iters),
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=max(1, decay_iters),
        wd_incr_style="constant",
        wsd_decay_steps=wsd if t.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style=t.lr_wsd_decay_style if t.lr_decay_style == "WSD" else None,
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
    )


def load_scheduler_state(scheduler: OptimizerParamScheduler, state: dict, where: str) -> None:
    """Restore a checkpoint's schedule; Megatron's scheduler asserts that the schedule itself did not change."""
    try:
        scheduler.load_state_dict(state)
    except AssertionError as e:
        raise ConfigError(f"the learning-rate schedule of this run differs from checkpoint {where}'s ({e}); pass the "
                          "checkpoint's --lr/--min-lr/--lr-warmup-iters/--lr-decay-iters/--lr-decay-style") from None
