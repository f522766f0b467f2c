"""The plain backend: the plain decoder (mega_depth/model/decoder.py, the one the Hugging Face export ships) on
torch-xla SPMD (a DATA x FSDP mesh, sharding.py), or eagerly on the CPU (`--device cpu`, the reference the XLA
runs are checked against). Same keyed initial weights, data, LR schedule and loss as the Megatron trainer:
--micro-batch-size is per batch shard, and the step's loss is the mean over (micro-batch, shard) of each one's
token-mean, as Megatron computes it over data-parallel ranks.

Checkpoints ("plain" format): model.safetensors in canonical names (full tensors gathered from the mesh) and
trainer_state.pt (optimizer, schedule, RNG: tensors and plain values only, loaded with weights_only=True). The
layout-free format makes resuming on another mesh exact.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from mega_depth.checkpoint.plain import SingleProcess
from mega_depth.config import Config, ConfigError
from mega_depth.model.moe import MoEMLP, update_expert_bias
from mega_depth.training import rng
from mega_depth.training.loss import token_mean_loss

WEIGHTS = "model.safetensors"
TRAINER_STATE = "trainer_state.pt"


def group_mean_loss(logits, labels, loss_mask, groups: int, poison: bool = False):
    """Mean over `groups` equal slices of the batch of each slice's masked token-mean (fp32 cross entropy):
    what Megatron computes over `groups` data-parallel ranks. logits [b, s, V]; labels, loss_mask [b, s]."""
    import torch.nn.functional as F

    b, s = labels.shape
    losses = F.cross_entropy(logits.float().reshape(b * s, -1), labels.reshape(-1), reduction="none").view(b, s)
    per_group = [token_mean_loss(l, m, poison) for l, m in zip(losses.view(groups, b // groups, s),
                                                               loss_mask.view(groups, b // groups, s))]
    return torch.stack(per_group).mean()


def canonical_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Full fp32 CPU copies under canonical names (a tied LM head is stored once, as the embedding)."""
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
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


class PlainBackend(SingleProcess):  # its collectives: one SPMD program
    format = "plain"

    def __init__(self, cfg: Config, device: str = "xla", mesh: Optional[str] = None):
        from mega_depth.init import seed_everything
        from mega_depth.xla.sharding import Layout, xla_layout

        self.cfg, self.xla = cfg, device == "xla"
        self.mesh_layout = xla_layout(mesh) if self.xla else Layout()
        cfg.validate(self.mesh_layout.batch_shards)
        self.num_microbatches = cfg.num_microbatches(self.mesh_layout.batch_shards)
        seed_everything(cfg.training.seed)
        if self.xla:
            import torch_xla

            self.device = torch_xla.device()
        else:
            self.device = torch.device("cpu")

    def peak_flops(self):
        return None  # TPU peaks are not tabulated: no MFU on the console

    def parameters_on_rank(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def memory_gb(self) -> float:
        import psutil

        return psutil.Process().memory_info().rss / 2**30

    @property
    def sampler_shape(self):
        # One SPMD program sees the whole global micro-batch: the shards' micro-batches side by side, in the
        # order Megatron's data-parallel ranks read them.
        return self.cfg.training.micro_batch_size * self.mesh_layout.batch_shards, self.num_microbatches, 1, 0

    def layout(self) -> dict:
        lay = self.mesh_layout
        return {"devices": lay.batch_shards, "mesh": [lay.data, lay.fsdp], "device": "xla" if self.xla else "cpu"}

    # --- build ------------------------------------------------------------------------------------------------------
    def build(self, initial_weights: Optional[Dict[str, torch.Tensor]] = None) -> None:
        from mega_depth.init import init_plain_model, padded_vocab_size
        from mega_depth.model.decoder import CausalLM
        from mega_depth.model.state_dict_adapter import to_canonical
        from mega_depth.training.schedule import build_scheduler

        cfg, t = self.cfg, self.cfg.training
        dc = cfg.decoder_config(padded_vocab_size(cfg.model.vocab_size))
        model = CausalLM(dc)
        init_plain_model(model, t.seed, cfg.model.init_method_std)
        if initial_weights is not None:
            self._load_canonical(model, to_canonical(initial_weights, dc), "the loaded weights")
        self.model = model.to(self.device)
        self.model.tie_weights()
        self.mesh_layout.shard_params(self.model)
        rule = model.model.mechanism
        named = list(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for n, p in named if rule.weight_decay_applies(n, p)], "wd_mult": 1.0},
             {"params": [p for n, p in named if not rule.weight_decay_applies(n, p)], "wd_mult": 0.0}],
            lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.params = [p for _, p in named]
        self.moe = {i: layer.mlp for i, layer in enumerate(self.model.model.layers) if isinstance(layer.mlp, MoEMLP)}
        m = cfg.model
        for mlp in self.moe.values():  # Megatron's load-balancing loss: per data-parallel rank's micro-batch
            mlp.load_balancing = (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, self.mesh_layout.batch_shards)
        self._interval = {"counts": {}, "losses": {}, "microbatches": 0}

    def _load_canonical(self, model, weights: Dict[str, torch.Tensor], where: str) -> None:
        device = next(model.parameters()).device
        with torch.no_grad():
            missing, unexpected = model.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and model.cfg.tie_word_embeddings)]
        if missing or unexpected:
            raise ConfigError(f"{where} do not match the model (missing {missing[:4]}, unexpected {unexpected[:4]})")

    # --- step -------------------------------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _forward_loss(self, batch, poison: bool = False):
        tokens, labels, mask, positions = (self.mesh_layout.shard_batch(batch[k].to(self.device))
                                           for k in ("tokens", "labels", "loss_mask", "position_ids"))
        with torch.autocast("xla" if self.xla else "cpu", dtype=torch.bfloat16, enabled=self.cfg.training.bf16):
            logits = self.model(tokens, positions)
        return group_mean_loss(logits, labels, mask, self.mesh_layout.batch_shards, poison)

    def forward_backward(self, microbatches, poison: bool = False) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        total, step_counts = None, {}
        for batch in microbatches:
            loss = self._forward_loss(batch, poison) / len(microbatches)
            # the MoE layers' load-balancing losses join the backward (not the reported loss), as Megatron's do
            aux = [mlp.aux_loss for mlp in self.moe.values() if mlp.aux_loss is not None]
            (loss + sum(aux) / len(microbatches) if aux else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
            self._record_routing(step_counts)
        self._update_expert_bias(step_counts)
        # one graph for the forward, the backward and the loss: a bare loss read would run a loss-only graph, and
        # the update's graph would then run the forward again for the gradients
        self._sync()
        return float(total.item())  # one host sync per step: the NaN policy must see the loss before the update

    def _record_routing(self, step_counts: dict) -> None:
        """This micro-batch's tokens per expert and load-balancing losses (/ coeff, as Megatron records them)."""
        interval, coeff = self._interval, self.cfg.model.moe_aux_loss_coeff
        for i, mlp in self.moe.items():
            step_counts[i] = step_counts.get(i, 0) + mlp.tokens_per_expert
            interval["counts"][i] = interval["counts"].get(i, 0) + mlp.tokens_per_expert
            if mlp.aux_loss is not None:
                interval["losses"][i] = interval["losses"].get(i, 0) + mlp.aux_loss.detach() / coeff
        interval["microbatches"] += 1 if self.moe else 0

    def _update_expert_bias(self, step_counts: dict) -> None:
        """DeepSeek-V3's expert-bias step after the step's backward (where Megatron's finalize_model_grads does it)."""
        for i, mlp in self.moe.items():
            if mlp.gate.e_score_correction_bias is not None:
                update_expert_bias(mlp.gate.e_score_correction_bias, step_counts[i],
                                   self.cfg.model.moe_router_bias_update_rate)

    def moe_metrics(self):
        """The routing since the last call: tokens per expert and load-balancing loss per MoE layer."""
        if not self.moe:
            return None
        interval = self._interval
        out = {"tokens_per_expert": {i: [float(c) for c in interval["counts"].get(i, torch.zeros(1)).tolist()]
                                     for i in self.moe}}
        if interval["losses"]:
            out["load_balancing_loss"] = {i: float(v) / max(interval["microbatches"], 1)
                                          for i, v in interval["losses"].items()}
        self._interval = {"counts": {}, "losses": {}, "microbatches": 0}
        return out

    def update(self):
        clip = self.cfg.training.clip_grad or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        self.optimizer.step()
        self.scheduler.step(increment=1)
        self._sync()
        return float(grad_norm.item()), True

    def discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()

    def evaluate(self, microbatches) -> float:
        self.model.eval()
        try:
            with torch.no_grad():
                losses = [float(self._forward_loss(b).item()) for b in microbatches]
                self._sync()
        finally:
            self.model.train()
        return sum(losses) / len(losses)

    def heatmap_figures(self, microbatches):
        from mega_depth.model.base import Recorder

        mechanism = self.model.model.mechanism
        if not mechanism.mixes_depth:
            return None
        mechanism.recorder = recorder = Recorder()
        try:
            self.evaluate(microbatches[-1:])
        finally:
            mechanism.recorder = None
        return recorder.figures

    def _sync(self) -> None:
        if self.xla:
            import torch_xla

            torch_xla.sync()

    # --- checkpoints ------------------------------------------------------------------------------------------------
    def save_files(self, tmp_dir: str, step: int) -> None:
        from safetensors.torch import save_file

        from mega_depth.training.schedule import scheduler_state

        save_file(canonical_state(self.model), os.path.join(tmp_dir, WEIGHTS), metadata={"format": "pt"})
        state = {"optimizer": _to_cpu(self.optimizer.state_dict()), "scheduler": scheduler_state(self.scheduler),
                 "step": step, "rng": rng.capture()}
        if self.xla:  # the XLA device draws dropout from its own generator, which torch's CPU state does not hold
            import torch_xla.core.xla_model as xm

            state["xla_rng"] = int(xm.get_rng_state())
        torch.save(state, os.path.join(tmp_dir, TRAINER_STATE))

    def load(self, ckpt_dir: str, meta: dict) -> int:
        from safetensors.torch import load_file

        from mega_depth.training.schedule import load_scheduler_state

        self._load_canonical(self.model, load_file(os.path.join(ckpt_dir, WEIGHTS)), f"{ckpt_dir}'s weights")
        state = torch.load(os.path.join(ckpt_dir, TRAINER_STATE), map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        load_scheduler_state(self.scheduler, state["scheduler"], ckpt_dir)
        if "rng" in state:
            rng.restore(state["rng"])
        if self.xla and "xla_rng" in state:  # a save from --device cpu (or an older one) leaves the seeded state
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(state["xla_rng"])
        return int(state["step"])

    def close(self) -> None:
        pass
