"""The DeepSpeed backend: the Megatron-core model under the DeepSpeed engine (ZeRO 0-3, data parallelism).

Launch with the `deepspeed` launcher (launch/deepspeed.sh) or torchrun. DeepSpeed owns the optimizer, ZeRO
partitioning, gradient accumulation and clipping; Megatron's pipeline schedules and tensor parallelism stay on the
Megatron backend (config.validate refuses --deepspeed with PP > 1 or TP > 1, with the reason). mega_depth sets
the batch keys of the DeepSpeed config from its own flags so the two can never disagree.

Skipping an update (--on-nan skip): the loss of a bad step is NaN and so are its gradients (token_mean_loss),
which DeepSpeed's own overflow check skips for ZeRO 1-3 and bf16; ZeRO-0 in fp32 has no such check, so the
boundary step is taken with the inner optimizer's step disabled (counters advance, weights and state do not move).
Checkpoints: DeepSpeed's own files under iter_N/deepspeed/, plus model.safetensors (canonical names, for export).
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, Optional

import torch

from mega_depth.config import Config, ConfigError
from mega_depth.init import padded_vocab_size
from mega_depth.training import rng
from mega_depth.training.distributed import Collectives, device, to_device
from mega_depth.training.host_sync import intended
from mega_depth.training.schedule import build_scheduler, load_scheduler_state, scheduler_state
from mega_depth.training.loss import token_mean_loss

TAG = "deepspeed"


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

    # the names DeepSpeed's universal-checkpoint loader asks for
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self):
        return self.ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self):
        return self.ps.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return self.ps.get_data_parallel_group()


def read_ds_config(path: str) -> dict:
    """The --deepspeed-config file as a dict, its ZeRO stage checked; one line for a missing or bad file."""
    try:
        with open(path) as f:
            ds = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed-config {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"--deepspeed-config {path} is a folder, not a JSON file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed-config {path} is not valid JSON: {e}") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"--deepspeed-config {path} must hold a JSON object")
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, not {stage!r}")
    # the trainer owns the precision and the schedule: DeepSpeed's own would train another model than the one
    # the config records (fp16's loss scale is also not applied to the MoE auxiliary loss's gradient)
    for key, fix in (("fp16", "use --bf16"), ("amp", "use --bf16"),
                     ("scheduler", "set the schedule with --lr-decay-style, --lr-warmup-iters and --lr-decay-iters")):
        block = ds.get(key)
        if block is not None and (key == "scheduler" or (isinstance(block, dict) and block.get("enabled", False))):
            raise ConfigError(f"{path}: the \"{key}\" block is not supported: remove it and {fix}")
    return ds


def _refuse_differing(ds: dict, path: str, owned: dict) -> None:
    """A value the run's flags own, set in the file to another value, is refused (the run records its flags: a
    silently overwritten file would not train as its author meant); an equal value or "auto" is fine."""
    for keys, (value, flags) in owned.items():
        node = ds
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or keys[-1] not in node:
            continue
        given = node[keys[-1]]
        same = given == "auto" or given == value or (
            isinstance(given, (int, float)) and not isinstance(given, bool) and isinstance(value, (int, float))
            and math.isclose(given, value, rel_tol=1e-12))
        if not same:
            raise ConfigError(f"{path}: {'.'.join(keys)} is {given!r}, but the run's flags ({flags}) give {value!r}; "
                              f"remove it from the file (the flags set it), or change {flags}")


def ds_config(cfg: Config, dp: int, num_microbatches: int) -> dict:
    ds = read_ds_config(cfg.training.deepspeed_config)
    t = cfg.training
    batch = "--global-batch-size and --micro-batch-size"
    _refuse_differing(ds, t.deepspeed_config, {
        ("train_micro_batch_size_per_gpu",): (t.micro_batch_size, "--micro-batch-size"),
        ("gradient_accumulation_steps",): (num_microbatches, batch),
        ("train_batch_size",): (t.micro_batch_size * num_microbatches * dp, batch),
        ("gradient_clipping",): (t.clip_grad, "--clip-grad"),
        ("optimizer", "params", "lr"): (t.lr, "--lr"),
        ("optimizer", "params", "betas"): ([t.adam_beta1, t.adam_beta2], "--adam-beta1 and --adam-beta2"),
        ("optimizer", "params", "eps"): (t.adam_eps, "--adam-eps"),
        ("optimizer", "params", "weight_decay"): (t.weight_decay, "--weight-decay")})
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    ds["gradient_accumulation_steps"] = num_microbatches
    ds["train_batch_size"] = t.micro_batch_size * num_microbatches * dp
    ds["gradient_clipping"] = t.clip_grad
    ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    ds["optimizer"].setdefault("params", {}).update(
        {"lr": t.lr, "betas": [t.adam_beta1, t.adam_beta2], "eps": t.adam_eps, "weight_decay": t.weight_decay})
    if not torch.cuda.is_available():
        ds["optimizer"]["params"].setdefault("torch_adam", True)  # CPU: no 100 s JIT build of fused Adam
    own = ds.get("bf16")
    if isinstance(own, dict) and own.get("enabled", False) and not t.bf16:
        raise ConfigError(f"{t.deepspeed_config}: \"bf16\" is enabled there but the run is fp32: pass --bf16 (or "
                          "disable it in the file), so that the model, its record and DeepSpeed agree")
    ds["bf16"] = {"enabled": bool(t.bf16)}
    ds.setdefault("steps_per_print", 1 << 30)  # the trainer logs; DeepSpeed's own progress lines are noise
    return ds


def _conversion_input(tag_dir: str, folder: str) -> str:
    """The checkpoint as ds_to_universal reads it: its files linked, the model states without Megatron's empty
    `_extra_state` entries (None, which the converter cannot cast; Megatron's modules restore them on load)."""
    inp = os.path.join(folder, "input")
    os.makedirs(inp)
    for name in os.listdir(tag_dir):
        path = os.path.join(tag_dir, name)
        if name.startswith("mp_rank_") and name.endswith("_model_states.pt"):
            state = torch.load(path, map_location="cpu", weights_only=False)  # DeepSpeed's own format
            state["module"] = {k: v for k, v in state["module"].items() if v is not None}
            torch.save(state, os.path.join(inp, name))
        else:
            os.symlink(path, os.path.join(inp, name))
    return inp


def _name_model_states(tag_dir: str, stage: int) -> None:
    """The model-states file under the name an engine of `stage` looks for (ZeRO-3 engines read
    zero_pp_rank_0_mp_rank_XX_model_states.pt, the others mp_rank_XX_model_states.pt); the universal conversion
    keeps the source stage's name."""
    import shutil

    for name in os.listdir(tag_dir):
        if not name.endswith("_model_states.pt"):
            continue
        mp = name[name.index("mp_rank_"):]
        wanted = f"zero_pp_rank_0_{mp}" if stage == 3 else mp
        if not os.path.exists(os.path.join(tag_dir, wanted)):
            shutil.copy2(os.path.join(tag_dir, name), os.path.join(tag_dir, wanted))


def _optimizer_state_for_zero3(input_dir: str, tag_dir: str) -> None:
    """ZeRO-3's universal loader reads the optimizer's step and hyper-parameters from optimizer_state.pt under
    "optimizer_state_dict", where a ZeRO-1/2 source's conversion leaves them at the top level and in the base
    optimizer's state: add them there (the moments and fp32 weights are per parameter, the same for every stage)."""
    import glob

    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT, PARAM_GROUPS

    path = os.path.join(tag_dir, "zero", "optimizer_state.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    source = sorted(glob.glob(os.path.join(input_dir, "*zero_pp_rank_0_*optim_states.pt")))[0]
    base = torch.load(source, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_DICT][BASE_OPTIMIZER_STATE]
    step = next(iter(base["state"].values()))["step"]
    state[OPTIMIZER_STATE_DICT] = {"state": {0: {"step": step}}, "param_groups": state[PARAM_GROUPS]}
    torch.save(state, path)


def _zero3_state_for_stages_1_2(tag_dir: str) -> None:
    """A ZeRO-3 source's conversion stores each parameter's state as bare tensors and its optimizer step only in
    optimizer_state.pt; ZeRO-1/2's universal loader reads {"param": tensor} files, a step.pt per parameter and the
    DeepSpeed version: write them so."""
    import deepspeed
    from deepspeed.checkpoint.constants import CAT_DIM, DS_VERSION, OPTIMIZER_STATE_DICT, PARAM

    zero = os.path.join(tag_dir, "zero")
    path = os.path.join(zero, "optimizer_state.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    step = torch.as_tensor(state[OPTIMIZER_STATE_DICT]["state"][0]["step"])
    state[DS_VERSION] = deepspeed.__version__
    torch.save(state, path)
    for name in os.listdir(zero):
        folder = os.path.join(zero, name)
        if not os.path.isdir(folder):
            continue
        for file in os.listdir(folder):
            value = torch.load(os.path.join(folder, file), map_location="cpu", weights_only=True)
            if torch.is_tensor(value):
                torch.save({PARAM: value, CAT_DIM: 0}, os.path.join(folder, file))
        torch.save(step.clone(), os.path.join(folder, "step.pt"))


class DeepSpeedBackend(Collectives):
    format = "deepspeed"

    def __init__(self, cfg: Config):
        from megatron.core import parallel_state

        from mega_depth.training.backends.startup import start_megatron

        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        import deepspeed

        self.cfg = cfg
        # the model is Megatron-core's, every rank holds all of it
        self._megatron_groups = start_megatron(cfg, data_parallel_only=True)
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        self.num_microbatches = cfg.num_microbatches(self.world_size)
        self.dp, self.dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()

    @property
    def sampler_shape(self):
        return self.cfg.training.micro_batch_size, self.num_microbatches, self.dp, self.dp_rank

    def layout(self) -> Dict[str, int]:
        return {"pp": 1, "tp": 1, "dp": self.dp, "zero_stage": self.engine.zero_optimization_stage()}

    def parameters_on_rank(self) -> int:
        """The parameters this rank's model holds (ZeRO-3's partitioned ones by their full size: the memory
        estimate divides them)."""
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters())

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    def build(self, initial_weights: Optional[Dict[str, torch.Tensor]] = None) -> None:
        import deepspeed

        from mega_depth.megatron.builder import build_model_chunks, load_full_state

        (model,) = build_model_chunks(self.cfg)
        if initial_weights is not None:  # before initialize: ZeRO-3 partitions the weights there
            load_full_state([model], initial_weights, self.cfg)
        self.mechanism = getattr(model.decoder, "mechanism", None)
        from mega_depth.megatron.moe_metrics import RoutingMetrics

        self.routing = RoutingMetrics.for_model(self.cfg, [model], device())  # the same Megatron MoE layers
        rule = self.cfg.decoder_config().mechanism()
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if rule.weight_decay_applies(n, p)], "wd_mult": 1.0},
                  {"params": [p for n, p in named if not rule.weight_decay_applies(n, p)], "wd_mult": 0.0}]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=groups, config=ds_config(self.cfg, self.dp, self.num_microbatches),
            mpu=_MegatronMPU())
        self.scheduler = build_scheduler(self.cfg, self.optimizer)

    # --- step -------------------------------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _losses(self, microbatches, poison: bool, train: bool) -> float:
        if train and self.routing is not None:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            # Megatron's schedule sets the load-balancing loss's backward scale; here DeepSpeed averages the
            # micro-batches' gradients, so the loss of each takes 1 / micro-batches too
            MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=device()) / len(microbatches))
            self.routing.add_microbatches(len(microbatches))
        losses = []
        for i, batch in enumerate(microbatches):
            batch = to_device(batch)
            per_token = self.engine(batch["tokens"], batch["position_ids"], attention_mask=None,
                                    labels=batch["labels"])
            loss = token_mean_loss(per_token, batch["loss_mask"], poison)
            if train:
                self.engine.backward(loss)
                if i < len(microbatches) - 1:
                    self.engine.step()  # inside the accumulation window: no update
            losses.append(loss.detach())
        mean = torch.stack(losses).mean().reshape(1)
        torch.distributed.all_reduce(mean)
        with intended("the step's loss, for logging and the NaN policy"):  # the step's one host sync
            return float(mean.item()) / self.dp

    def forward_backward(self, microbatches, poison: bool = False) -> float:
        return self._losses(microbatches, poison, train=True)  # the boundary step is update()'s or discard()'s

    def update(self):
        e = self.engine
        # ZeRO-0 without bf16/fp16 steps a plain torch optimizer and records no norm: measure it before the step
        # (the gradients are data-parallel averaged by then), as the other stages report theirs
        plain = not (e.zero_optimization() or e.bfloat16_enabled() or e.fp16_enabled())
        norm = self._grad_norm() if plain else None
        self._update_expert_bias()
        e.step()
        applied = e.was_step_applied()
        if applied:
            self.scheduler.step(increment=1)
        if norm is None:
            norm = e.get_global_grad_norm()
        return (float(norm) if norm is not None else float("nan")), bool(applied)

    def _update_expert_bias(self) -> None:
        """What Megatron's finalize_model_grads does for the expert bias (DeepSpeed's step does not call it)."""
        config = self.engine.module.config
        if getattr(config, "moe_router_enable_expert_bias", False):
            from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias, \
                reset_model_temporary_tensors

            _update_router_expert_bias([self.engine.module], config)
            reset_model_temporary_tensors(config, [self.engine.module])

    def moe_metrics(self):
        """Collective: the routing since the last call (megatron/moe_metrics.py), or None for a dense model."""
        return self.routing.read() if self.routing is not None else None

    def _grad_norm(self):
        """The L2 norm of every gradient (a tensor; read on the host with the loss)."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return None
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))

    def discard(self) -> None:
        """Take the boundary step without an update (the gradients are NaN: see the module doc)."""
        e = self.engine
        # the router counted this step's tokens: Megatron and XLA move the expert bias by them and reset them on a
        # skipped step too (the counts are finite), so this step must not leave them to the next update
        self._update_expert_bias()
        builtin = e.zero_optimization() or e.bfloat16_enabled() or e.fp16_enabled()
        if builtin:
            e.step()
        else:
            inner = e.optimizer
            saved = inner.__dict__.get("step")  # an LR scheduler may have patched an instance attribute
            inner.step, inner.overflow = (lambda *a, **k: None), True  # no update; DeepSpeed counts a skip
            try:
                e.step()
            finally:
                if saved is None:
                    del inner.step
                else:
                    inner.step = saved
                inner.overflow = False
        if e.was_step_applied():
            raise RuntimeError("DeepSpeed applied an update that should have been skipped")

    def evaluate(self, microbatches) -> float:
        self.engine.eval()
        try:
            with torch.no_grad():
                return self._losses(microbatches, False, train=False)
        finally:
            self.engine.train()

    def heatmap_figures(self, microbatches):
        from mega_depth.model.base import Recorder

        if self.mechanism is None:
            return None
        self.mechanism.recorder = recorder = Recorder()
        try:
            self.evaluate(microbatches[-1:])
        finally:
            self.mechanism.recorder = None
        return self.gather_figures(recorder.figures)

    # --- checkpoints ------------------------------------------------------------------------------------------------
    def _full_module_state(self) -> Optional[Dict[str, torch.Tensor]]:
        """The module's full weights on rank 0 (ZeRO-3 gathers its partitions: collective)."""
        if self.engine.zero_optimization_stage() == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self.engine.module.state_dict()
        if self.rank != 0:
            return None
        return {k: v.detach().float().cpu() for k, v in state.items() if not k.endswith("_extra_state")}

    def save_files(self, tmp_dir: str, step: int) -> None:
        from safetensors.torch import save_file

        from mega_depth.model.state_dict_adapter import to_canonical

        from megatron.core import tensor_parallel

        # Megatron's layers draw attention dropout from the model-parallel tracker: without it a resume is not exact
        client = {"step": step, "scheduler": scheduler_state(self.scheduler),
                  "rng": rng.capture(tensor_parallel.get_cuda_rng_tracker())}
        self.engine.save_checkpoint(tmp_dir, tag=TAG, client_state=client, save_latest=False)
        full = self._full_module_state()
        if full is not None:
            dc = self.cfg.decoder_config(padded_vocab_size(self.cfg.model.vocab_size))
            canonical = {k: v.contiguous() for k, v in to_canonical(full, dc).items()}
            save_file(canonical, os.path.join(tmp_dir, "model.safetensors"), metadata={"format": "pt"})

    def load(self, ckpt_dir: str, meta: dict) -> int:
        saved = meta.get("layout", {})
        stage = self.engine.zero_optimization_stage()
        if saved.get("dp", self.dp) == self.dp and saved.get("zero_stage", stage) == stage:
            path, client = self.engine.load_checkpoint(ckpt_dir, tag=TAG)
        else:
            path, client = self._load_universal(ckpt_dir, saved.get("dp"), saved.get("zero_stage"), stage)
        if path is None or client is None:
            raise ConfigError(f"{ckpt_dir} holds no DeepSpeed checkpoint ({TAG}/ is missing)")
        load_scheduler_state(self.scheduler, client["scheduler"], ckpt_dir)
        if meta.get("layout", {}).get("dp") == self.dp and "rng" in client:
            from megatron.core import tensor_parallel

            rng.restore(client["rng"], tensor_parallel.get_cuda_rng_tracker())  # older saves: no tracker, reseeded
        return int(client["step"])

    def _load_universal(self, ckpt_dir: str, dp: int, stage_from: int, stage_to: int):
        """A checkpoint saved at another data-parallel size or ZeRO stage: DeepSpeed partitions optimizer state by
        both, so it is converted to DeepSpeed's universal checkpoint (deepspeed.checkpoint.ds_to_universal, into a
        temporary folder beside it), loaded from there, and the conversion deleted."""
        import tempfile
        import types

        moved = f"ZeRO-{stage_from} at data-parallel size {dp} -> ZeRO-{stage_to} at {self.dp}"
        if 0 in (stage_from, stage_to):
            raise ConfigError(f"{ckpt_dir} was saved with {moved.split(' -> ')[0]}, this run uses ZeRO-{stage_to} at "
                              f"data-parallel size {self.dp}: DeepSpeed's universal checkpoint converts between ZeRO "
                              "stages 1-3 only; resume with the saved stage and size, or start from its weights "
                              f"(tools/convert_from_hf.py --hf {ckpt_dir} --save DIR, then --load DIR)")
        folder = None
        if self.rank == 0:
            folder = tempfile.mkdtemp(prefix=".universal-", dir=os.path.dirname(os.path.abspath(ckpt_dir)))
        folder = self.broadcast(folder)
        try:
            error = None
            if self.rank == 0:
                from deepspeed.checkpoint import ds_to_universal

                args = types.SimpleNamespace(input_folder=_conversion_input(os.path.join(ckpt_dir, TAG), folder),
                                             output_folder=os.path.join(folder, TAG), num_extract_workers=1,
                                             num_merge_workers=1, keep_temp_folder=False, strict=True,
                                             inject_missing_state=True)  # TP 1: no TP patterns to record
                try:
                    ds_to_universal.main(args)
                    _name_model_states(args.output_folder, stage_to)
                    if stage_to == 3 and stage_from < 3:
                        _optimizer_state_for_zero3(args.input_folder, args.output_folder)
                    elif stage_from == 3 and stage_to < 3:
                        _zero3_state_for_stages_1_2(args.output_folder)
                except Exception as e:  # the conversion's own failure: one line, and the folder stays as it was
                    error = f"{type(e).__name__}: {str(e)[:120]}"
            error = self.broadcast(error)
            if error:
                raise ConfigError(f"{ckpt_dir} ({moved}): DeepSpeed's universal checkpoint conversion failed "
                                  f"({error}); resume with the saved ZeRO stage and data-parallel size")
            # The universal loaders give every parameter group the first group's hyper-parameters ("generally the
            # same"): keep this run's own (the no-decay group's weight decay of 0); the LR comes from the scheduler.
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            self.engine._config.load_universal_checkpoint = True
            try:
                path, client = self.engine.load_checkpoint(folder, tag=TAG)
            finally:
                self.engine._config.load_universal_checkpoint = False
            for group, own in zip(self.optimizer.param_groups, groups):
                group.update(own)
            # ZeRO-3's universal loader hands every parameter group one shared `step` tensor, which Adam then
            # advances once per group: a wrong bias correction from the first step on. Each group gets its own.
            for state in self.engine.optimizer.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
            if self.rank == 0:
                print(f"resharded {ckpt_dir} through DeepSpeed's universal checkpoint ({moved})", flush=True)
            return path, client
        finally:
            self.barrier()
            if self.rank == 0:
                import shutil

                shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        from mega_depth.training.backends.startup import stop_megatron

        stop_megatron(self._megatron_groups)  # DeepSpeed's own groups stay: its module state may hold them
