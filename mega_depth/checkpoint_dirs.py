"""The checkpoint directory convention shared by every trainer (Megatron, DeepSpeed, plain/XLA).

    --save DIR/
      iter_0000010/                      one complete checkpoint; its mega_depth.json holds the step and config
      latest_checkpointed_iteration.txt  the step of the newest COMPLETE checkpoint
Writers fill iter_N.tmp/ and rename it, then replace the pointer atomically; a kill mid-save loses nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from mega_depth.config import Config, ConfigError, to_dict

POINTER = "latest_checkpointed_iteration.txt"
META = "mega_depth.json"
# What must match between a checkpoint and the run that loads it (the parallel layout may differ).
_MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
               "vocab_size", "qk_layernorm", "untie_embeddings_and_output_weights")
_RESIDUAL_KEYS = ("residual", "attnres_num_blocks", "dca_last_k", "dca_grn", "depth_attn_stride",
                  "depth_attn_window", "depth_attn_gqa")


def iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def latest_step(root: str) -> Optional[int]:
    path = os.path.join(root, POINTER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit() or not os.path.isdir(iter_dir(root, int(text))):
        raise ConfigError(f"{path} names {text!r}, which is not a complete checkpoint in {root}")
    return int(text)


def read_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, META)
    if not os.path.isfile(path):
        raise ConfigError(f"{ckpt_dir} is not a mega_depth checkpoint (no {META})")
    with open(path) as f:
        return json.load(f)


def resolve(load: str) -> str:
    """--load may be a save root (use its latest pointer) or one iter_N directory."""
    if os.path.isfile(os.path.join(load, META)):
        return load
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load} does not exist")
    step = latest_step(load)
    if step is None:
        raise ConfigError(f"--load {load} holds no checkpoint ({POINTER} missing); point it at a --save directory "
                          "or at one iter_N directory")
    return iter_dir(load, step)


def check_compatible(meta: dict, cfg: Config, where: str) -> None:
    saved_m, saved_r = meta["config"]["model"], meta["config"]["residual"]
    now_m, now_r = to_dict(cfg)["model"], to_dict(cfg)["residual"]
    diffs = [f"--{k.replace('_', '-')}: checkpoint {saved_r[k]!r}, this run {now_r[k]!r}"
             for k in _RESIDUAL_KEYS if saved_r.get(k) != now_r.get(k)]
    diffs += [f"--{k.replace('_', '-')}: checkpoint {saved_m[k]!r}, this run {now_m[k]!r}"
              for k in _MODEL_KEYS if saved_m.get(k) != now_m.get(k)]
    if diffs:
        raise ConfigError(f"checkpoint {where} was trained with a different model or mechanism: " + "; ".join(diffs)
                          + ". Pass the checkpoint's flags (or its --config), or start without --load.")


def prune(root: str, keep: int) -> None:
    steps = sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("iter_") and n[5:].isdigit())
    for step in steps[:-keep]:
        shutil.rmtree(iter_dir(root, step), ignore_errors=True)


def write_pointer(root: str, step: int) -> None:
    tmp = os.path.join(root, POINTER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, POINTER))
