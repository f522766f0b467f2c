"""Checkpoints of the plain/XLA trainer, in the shared directory convention (checkpoint_dirs.py):

    iter_N/model.safetensors    canonical weights (Hugging Face names, fp32, full tensors gathered from the mesh)
    iter_N/trainer_state.pt     optimizer state, LR schedule, step
    iter_N/mega_depth.json      {"format": "plain", "step", "layout", "config"}
`tools/convert_to_hf.py --load` exports it directly; `tools/convert_from_hf.py --hf` turns it into a Megatron
checkpoint (any TP/PP layout can then --load it). The layout-free format also makes resuming on another mesh exact.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict

import torch

from mega_depth.checkpoint_dirs import META, check_compatible, iter_dir, prune, read_meta, resolve, write_pointer
from mega_depth.config import Config, ConfigError, to_dict

FORMAT = "plain"
WEIGHTS = "model.safetensors"
TRAINER_STATE = "trainer_state.pt"


def canonical_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Full fp32 CPU copies under canonical names (a tied LM head is stored once, as the embedding)."""
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    if getattr(model, "cfg", None) is not None and model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def save(model, optimizer, scheduler, cfg: Config, step: int, root: str, layout: dict) -> str:
    from safetensors.torch import save_file

    final, tmp = iter_dir(root, step), iter_dir(root, step) + ".tmp"
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(canonical_state(model), os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
    torch.save({"optimizer": _to_cpu(optimizer.state_dict()), "scheduler": scheduler.state_dict(), "step": step},
               os.path.join(tmp, TRAINER_STATE))
    with open(os.path.join(tmp, META), "w") as f:
        json.dump({"format": FORMAT, "step": step, "layout": layout, "config": to_dict(cfg)}, f, indent=1)
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    write_pointer(root, step)
    prune(root, cfg.checkpoint.keep_last)
    return final


def is_plain(ckpt_dir: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, META)) and read_meta(ckpt_dir).get("format") == FORMAT


def load_weights(ckpt_dir: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = os.path.join(ckpt_dir, WEIGHTS)
    if not os.path.isfile(path):
        raise ConfigError(f"{ckpt_dir} has no {WEIGHTS}: not a complete plain/XLA checkpoint")
    return load_file(path)


def load(model, optimizer, scheduler, cfg: Config, load_path: str) -> int:
    """Restore weights, optimizer and schedule; returns the step to continue from. Mesh changes are fine."""
    ckpt = resolve(load_path)
    meta = read_meta(ckpt)
    if meta.get("format") != FORMAT:
        raise ConfigError(f"--load {ckpt} is a Megatron checkpoint; the XLA trainer reads its own format. Export it "
                          "with tools/convert_to_hf.py and start from the Hugging Face weights, or train it with "
                          "python -m mega_depth.train")
    check_compatible(meta, cfg, ckpt)
    weights = load_weights(ckpt)
    device = next(model.parameters()).device
    with torch.no_grad():
        missing, unexpected = model.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and not cfg.model.untie_embeddings_and_output_weights)]
    if missing or unexpected:
        raise ConfigError(f"{ckpt}: its weights do not match its config (missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]})")
    state = torch.load(os.path.join(ckpt, TRAINER_STATE), map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    try:
        scheduler.load_state_dict(state["scheduler"])
    except AssertionError as e:
        raise ConfigError(f"the learning-rate schedule of this run differs from checkpoint {ckpt}'s ({e}); pass the "
                          "checkpoint's --lr/--min-lr/--lr-warmup-iters/--lr-decay-iters/--lr-decay-style") from None
    return int(state["step"])
