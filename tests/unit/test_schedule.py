"""The learning-rate schedule across a resume (mega_depth/training/schedule.py), on Megatron's scheduler over a plain
torch optimizer: WSD's final decay, which Megatron's scheduler state leaves out, is saved and follows the same
rule as the rest of the schedule (kept, refused when it changed, or this run's with the override)."""

import pytest
import torch

from mega_depth.config import ConfigError, parse_args
from mega_depth.training.schedule import build_scheduler, load_scheduler_state, scheduler_state

WSD = ["--mock-data", "--lr", "1.0", "--min-lr", "0", "--lr-warmup-iters", "10", "--train-iters", "1000",
       "--lr-decay-style", "WSD"]


def _scheduler(flags):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return build_scheduler(parse_args(flags).validate(1), optimizer)


def _lr(scheduler, step):
    scheduler.num_steps = step
    return scheduler.get_lr(scheduler.optimizer.param_groups[0])


def test_wsd_final_decay_is_kept_checked_or_overridden_across_a_resume():
    trained = _scheduler(WSD)  # the final decay: the last 100 of 1,000 steps
    trained.num_steps = 850
    state = scheduler_state(trained)
    expected = _lr(trained, 950)
    # the checkpoint's schedule kept (this run's flags say cosine over 2,000 steps): its WSD decay comes back
    kept = _scheduler(["--mock-data", "--lr", "1.0", "--train-iters", "2000", "--use-checkpoint-opt-param-scheduler"])
    load_scheduler_state(kept, state, "ckpt")
    assert _lr(kept, 950) == pytest.approx(expected) and _lr(kept, 850) == pytest.approx(1.0)
    # a plain resume with another final decay: refused, as any other change of the schedule
    with pytest.raises(ConfigError, match="--lr-wsd-decay-iters: checkpoint 100, this run 300"):
        load_scheduler_state(_scheduler(WSD + ["--lr-wsd-decay-iters", "300"]), state, "ckpt")
    load_scheduler_state(_scheduler(WSD), state, "ckpt")  # the same: fine
    # asked for: this run's
    overridden = _scheduler(WSD + ["--lr-wsd-decay-iters", "300", "--override-opt-param-scheduler"])
    load_scheduler_state(overridden, state, "ckpt")
    assert overridden.wsd_decay_steps == 300
    # a checkpoint from before the decay was saved, its schedule kept by a run whose flags say nothing of WSD
    old = {k: v for k, v in state.items() if k not in ("wsd_decay_steps", "lr_wsd_decay_style")}
    with pytest.raises(ConfigError, match="decays its learning rate by WSD but does not record"):
        load_scheduler_state(_scheduler(["--mock-data", "--train-iters", "2000",
                                         "--use-checkpoint-opt-param-scheduler"]), old, "ckpt")


def test_wsd_default_final_decay_fits_after_a_long_warm_up():
    """10 % of the decay by default, but no more than the steps after the warm-up: with 95 warm-up steps of 100,
    a 10-step decay began inside the warm-up, and the rate fell from 1.0 to 0.4 in one step at its end."""
    flags = ["--mock-data", "--lr", "1.0", "--min-lr", "0", "--lr-warmup-iters", "95", "--train-iters", "100",
             "--lr-decay-style", "WSD"]
    scheduler = _scheduler(flags)
    assert scheduler.wsd_decay_steps == 5
    lrs = [_lr(scheduler, step) for step in range(95, 101)]
    assert lrs == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])
    assert _scheduler(WSD).wsd_decay_steps == 100  # 10 % where it fits
