"""The learning-rate / weight-decay schedule: Megatron's OptimizerParamScheduler over any optimizer's param groups
(the Megatron optimizer, or a plain torch one on the XLA path). Only `lr_mult` / `wd_mult` of a group are read."""

from __future__ import annotations

from typing import Optional

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from mega_depth.config import Config, ConfigError


def build_scheduler(cfg: Config, optimizer) -> OptimizerParamScheduler:
    """Megatron's scheduler: linear warm-up, then constant / linear / cosine / inverse-square-root / WSD decay."""
    t = cfg.training
    decay_iters = t.lr_decay_iters or t.train_iters
    # by default 10 % of the decay, within the steps after the warm-up (as an explicit value must be: config.py),
    # else the decay would start inside the warm-up and the rate jump down at its end
    wsd = t.lr_wsd_decay_iters if t.lr_wsd_decay_iters is not None else \
        max(1, min(decay_iters // 10, decay_iters - t.lr_warmup_iters))
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
        use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=t.override_opt_param_scheduler,
    )


def steps_at_zero_lr(cfg: Config, saved_training: Optional[dict] = None) -> Optional[str]:
    """A warning line if steps past the end of the decay would train at lr 0 (Megatron's scheduler holds min_lr
    there): an extended --train-iters with the old --lr-decay-iters does that without a word otherwise.
    `saved_training`: the resumed checkpoint's training config, whose schedule --use-checkpoint-opt-param-scheduler
    keeps."""
    t, steps = cfg.training, cfg.training.train_iters
    schedule = dict(saved_training) if t.use_checkpoint_opt_param_scheduler and saved_training else vars(t)
    end = schedule.get("lr_decay_iters") or schedule.get("train_iters") or steps
    if schedule.get("lr_decay_style", "cosine") == "constant" or schedule.get("min_lr", 0.0) != 0 or steps <= end:
        return None
    return (f"warning: --train-iters {steps} runs past the end of the learning-rate decay (step {end}) with --min-lr "
            f"0: steps {end + 1}..{steps} train at lr 0. To decay over the whole run pass --lr-decay-iters {steps} "
            "(on a resume with --override-opt-param-scheduler), or set --min-lr")


# WSD's final decay, which Megatron's scheduler state leaves out (it is taken from the flags on every resume):
# saved beside it, and restored or checked with the rest
_WSD = (("wsd_decay_steps", "--lr-wsd-decay-iters"), ("lr_wsd_decay_style", "--lr-wsd-decay-style"))


def scheduler_state(scheduler: OptimizerParamScheduler) -> dict:
    """What a checkpoint keeps of the schedule: Megatron's state, and WSD's final decay."""
    return {**scheduler.state_dict(), **{key: getattr(scheduler, key) for key, _ in _WSD}}


def load_scheduler_state(scheduler: OptimizerParamScheduler, state: dict, where: str) -> None:
    """Restore a checkpoint's schedule. Megatron's scheduler asserts that the schedule did not change, unless
    --override-opt-param-scheduler (this run's flags) or --use-checkpoint-opt-param-scheduler (the checkpoint's);
    WSD's final decay (scheduler_state) follows the same rule."""
    fix = ("to change it (e.g. to extend --train-iters) pass --override-opt-param-scheduler, or "
           "--use-checkpoint-opt-param-scheduler to keep the checkpoint's, or pass the checkpoint's "
           "--lr/--min-lr/--lr-warmup-iters/--lr-decay-iters/--lr-decay-style")
    saved = {key: state[key] for key, _ in _WSD if key in state}  # (none: a checkpoint from before it was saved)
    if scheduler.use_checkpoint_opt_param_scheduler:  # before the load, whose last step computes the lr with them
        for key, value in saved.items():
            setattr(scheduler, key, value)
        if state.get("lr_decay_style") == "WSD" and scheduler.wsd_decay_steps is None:
            raise ConfigError(f"checkpoint {where} decays its learning rate by WSD but does not record WSD's final "
                              "decay (it predates that record); pass --lr-decay-style WSD with its "
                              "--lr-wsd-decay-iters and --lr-wsd-decay-style")
    elif not scheduler.override_opt_param_scheduler and scheduler.lr_decay_style == "WSD":
        for key, flag in _WSD:
            if key in saved and getattr(scheduler, key) != saved[key]:
                raise ConfigError(f"the learning-rate schedule of this run differs from checkpoint {where}'s ({flag}: "
                                  f"checkpoint {saved[key]!r}, this run {getattr(scheduler, key)!r}); {fix}, {flag}")
    try:
        scheduler.load_state_dict(state)
    except AssertionError as e:
        detail = str(e).replace("OptimizerParamScheduler: ", "")
        raise ConfigError(f"the learning-rate schedule of this run differs from checkpoint {where}'s ({detail}); "
                          f"{fix}") from None
