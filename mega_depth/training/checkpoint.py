"""Checkpoints with megatron-core dist_checkpointing: resumable, reshardable across TP/PP/DP layouts, atomic.

Layout of --save DIR:
    iter_0000010/                 a complete checkpoint (torch_dist shards + common.pt + metadata)
      mega_depth.json             model/mechanism config and the step, for validation and for export
    latest_checkpointed_iteration.txt   the step of the newest COMPLETE checkpoint
A save writes iter_N.tmp/ first, renames it when every rank has finished, then replaces the pointer file
atomically; a crash or kill during a save leaves the previous checkpoint and pointer intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from mega_depth.checkpoint_dirs import (META, check_compatible, iter_dir, prune, read_meta, resolve,
                                        write_pointer)
from mega_depth.config import Config, ConfigError, to_dict

def _rng_state() -> dict:
    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _layout() -> tuple:
    return (parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size())


def sharded_state(state, is_loading: bool = False) -> dict:
    """Everything a resume needs, as a dist_checkpointing state dict (model chunks, optimizer, RNG)."""
    model_sd = {}
    for i, chunk in enumerate(state.model):
        module = getattr(chunk, "module", chunk)
        model_sd[f"model{i}"] = module.sharded_state_dict()
    flat = {}
    for sd in model_sd.values():
        flat.update(sd)
    out = dict(model_sd)
    out["optimizer"] = state.optimizer.sharded_state_dict(
        flat, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    pp, tp, dp = _layout()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    # RNG per (pp, tp) rank; restored only when the layout is unchanged (a resharded run reseeds).
    out["rng_state"] = ShardedObject(f"rng_state_pp{pp}_tp{tp}", _rng_state(), (pp, tp), (pp_rank, tp_rank),
                                     replica_id=parallel_state.get_data_parallel_rank())
    return out


def save(state, step: int, root: str) -> str:
    """Save atomically as root/iter_<step>; returns its path. Collective over all ranks."""
    final, tmp = iter_dir(root, step), iter_dir(root, step) + ".tmp"
    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a previous kill mid-save
        os.makedirs(tmp)
    torch.distributed.barrier()
    sd = sharded_state(state)
    sd["common"] = {"step": step, "scheduler": state.scheduler.state_dict()}
    dist_checkpointing.save(sd, tmp)
    torch.distributed.barrier()
    if os.environ.get("MEGA_DEPTH_FAULT_KILL_IN_SAVE") == str(step):  # fault injection for the crash test
        _kill_self()
    if rank == 0:
        with open(os.path.join(tmp, META), "w") as f:
            json.dump({"step": step, "layout": dict(zip(("pp", "tp", "dp"), _layout())),
                       "config": to_dict(state.cfg)}, f, indent=1)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        write_pointer(root, step)
        prune(root, state.cfg.checkpoint.keep_last)
    torch.distributed.barrier()
    return final


def _kill_self() -> None:
    """SIGKILL this process and its helpers (the checkpoint writer's worker processes), as an OOM kill would."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def save_model_only(model_chunks, cfg: Config, root: str, step: int = 0) -> str:
    """A weights-only checkpoint (e.g. imported from Hugging Face): training loads it and starts fresh."""
    final, tmp = iter_dir(root, step), iter_dir(root, step) + ".tmp"
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    sd = {f"model{i}": getattr(c, "module", c).sharded_state_dict() for i, c in enumerate(model_chunks)}
    dist_checkpointing.save(sd, tmp)
    with open(os.path.join(tmp, META), "w") as f:
        json.dump({"step": step, "model_only": True, "layout": dict(zip(("pp", "tp", "dp"), _layout())),
                   "config": to_dict(cfg)}, f, indent=1)
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    write_pointer(root, step)
    return final


def load(state, load_path: str) -> int:
    """Restore model, optimizer, scheduler and (same layout) RNG; returns the step to continue from.
    A weights-only checkpoint restores the model and starts at step 0 with a fresh optimizer."""
    ckpt = resolve(load_path)
    meta = read_meta(ckpt)
    if meta.get("format") == "plain":
        raise ConfigError(f"--load {ckpt} was written by the XLA trainer; convert it first: python "
                          f"tools/convert_from_hf.py --hf {load_path} --save DIR, then --load DIR")
    check_compatible(meta, state.cfg, ckpt)
    if meta.get("model_only"):
        template = {f"model{i}": getattr(c, "module", c).sharded_state_dict() for i, c in enumerate(state.model)}
        loaded = dist_checkpointing.load(template, ckpt)
        for i, chunk in enumerate(state.model):
            getattr(chunk, "module", chunk).load_state_dict(loaded[f"model{i}"])
        state.optimizer.reload_model_params()  # the optimizer's fp32 copies follow the loaded weights
        return 0
    same_layout = tuple(meta["layout"][k] for k in ("pp", "tp", "dp")) == _layout()
    template = sharded_state(state, is_loading=True)
    if not same_layout:
        template.pop("rng_state")
    loaded = dist_checkpointing.load(template, ckpt)
    for i, chunk in enumerate(state.model):
        getattr(chunk, "module", chunk).load_state_dict(loaded[f"model{i}"])
    state.optimizer.load_state_dict(loaded["optimizer"])
    try:
        state.scheduler.load_state_dict(loaded["common"]["scheduler"])
    except AssertionError as e:  # megatron's scheduler asserts that the schedule did not change
        raise ConfigError(f"the learning-rate schedule of this run differs from checkpoint {ckpt}'s ({e}); pass the "
                          "checkpoint's --lr/--min-lr/--lr-warmup-iters/--lr-decay-iters/--lr-decay-style") from None
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return int(loaded["common"]["step"])
