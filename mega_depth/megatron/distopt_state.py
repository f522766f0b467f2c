"""The distributed optimizer's resume where neither Transformer Engine nor apex is installed.

Without them megatron-core 0.16.1 steps torch's AdamW, and its distributed optimizer keeps torch's per-parameter
step count in the checkpoint's param groups (one value for all). Three things on that path break a resume:
- `state_dict()` reads the step from the inner optimizer's state and asserts there is exactly one. A resume builds
  the state dict it loads into before any step, while that state is still empty, so the assert fails.
- `load_state_dict` sets each parameter's `step` from the groups, then copies every key of that state from the
  checkpoint's parameter state, which holds the weights and the two moments but no `step`: KeyError.
- it gives every parameter the same step tensor. Torch's AdamW (not fused) adds one to each parameter's step in
  place, so the shared tensor would advance once per parameter per step, and every update after the resume would
  use a wrong bias correction.

`apply()` is explicit (the Megatron backend calls it before it builds its optimizer) and idempotent, and it leaves
Megatron's own path alone where TE or apex provides the optimizer. Where it takes effect:
- the empty state gives step 0 to the state dict that the load overwrites;
- the load copies the keys the checkpoint has and keeps the step that the groups gave;
- each parameter then holds its own step tensor, on the parameter's device where the group is fused (as torch
  places it).
"""

from __future__ import annotations

import importlib

import torch

_APPLIED = False
_original = {}


def _state_dict(self):
    """DistributedOptimizer.state_dict, with step 0 for an optimizer that has not stepped yet."""
    inner = self.optimizer
    if inner.state:
        return _original["state_dict"](self)
    params = [p for group in inner.param_groups for p in group["params"]]
    for p in params:  # taken back below: the state stays what it was, empty
        inner.state[p]["step"] = torch.zeros((), dtype=torch.float32)
    try:
        return _original["state_dict"](self)
    finally:
        inner.state.clear()


def _set_main_param_and_optimizer_states(self, model_param, tensors):
    """DistributedOptimizer._set_main_param_and_optimizer_states, leaving out the step that the param groups set."""
    if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        return _original["set_states"](self, model_param, tensors)
    group_index, group_order = self.model_param_group_index_map[model_param]
    state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
    step = state.pop("step", None)
    try:
        return _original["set_states"](self, model_param, tensors)
    finally:
        if step is not None:
            state["step"] = step


def _load_state_dict(self, state_dict):
    """DistributedOptimizer.load_state_dict, after which each parameter holds its own step tensor."""
    _original["load_state_dict"](self, state_dict)
    own_steps(self.optimizer)


def own_steps(optimizer: torch.optim.Optimizer) -> int:
    """Give each parameter of a torch optimizer its own `step` tensor: on the parameter's device where its group is
    fused or capturable, else on the CPU (torch's placement). Returns how many were shared and are now copies."""
    seen, copied = set(), 0
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            state = optimizer.state.get(p)
            step = state.get("step") if state else None
            if not isinstance(step, torch.Tensor):
                continue
            device = p.device if on_device else torch.device("cpu")
            if id(step) in seen or step.device != device:
                copied += id(step) in seen
                state["step"] = step.detach().to(device=device, dtype=torch.float32, copy=True)
            seen.add(id(state["step"]))
    return copied


def apply() -> bool:
    """Patch megatron-core's distributed optimizer where it steps torch's AdamW (no TE, no apex). Returns whether it
    did."""
    global _APPLIED
    if _APPLIED:
        return True
    module = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    if module.HAVE_APEX_OR_TE:
        return False  # TE's or apex's fused Adam: Megatron's own path
    cls = module.DistributedOptimizer
    _original.update(state_dict=cls.state_dict, set_states=cls._set_main_param_and_optimizer_states,
                     load_state_dict=cls.load_state_dict)
    cls.state_dict = _state_dict
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    cls.load_state_dict = _load_state_dict
    _APPLIED = True
    return True
