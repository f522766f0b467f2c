"""The Megatron-core backend: model chunks (one per virtual stage), Megatron DDP, its optimizer (AdamW, optionally
distributed), the pipeline schedules, and torch_dist checkpoints that reshard between TP/PP/DP layouts."""

from __future__ import annotations

import contextlib
import os
import warnings
from functools import partial
from typing import Dict, List, Optional

import torch

from mega_depth.config import Config, ConfigError
from mega_depth.training import rng
from mega_depth.training.distributed import Collectives, device, to_device
from mega_depth.training.host_sync import intended
from mega_depth.megatron import distopt_state, grad_norm
from mega_depth.training.schedule import build_scheduler, load_scheduler_state, scheduler_state
from mega_depth.training.loss import token_mean_loss


class MegatronBackend(Collectives):
    format = "megatron"

    def __init__(self, cfg: Config):
        from mega_depth.training.backends.startup import start_megatron

        self.cfg = cfg
        self._megatron_groups = start_megatron(cfg)
        self.num_microbatches = cfg.num_microbatches(self.world_size)
        self.model: List[torch.nn.Module] = []
        self.step_graph = None

    # --- shape ------------------------------------------------------------------------------------------------------
    @property
    def sampler_shape(self):
        from megatron.core import parallel_state

        return (self.cfg.training.micro_batch_size, self.num_microbatches,
                parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank())

    def layout(self) -> Dict[str, int]:
        from megatron.core import parallel_state as ps

        return {"pp": ps.get_pipeline_model_parallel_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
                "cp": ps.get_context_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}

    def parameters_on_rank(self) -> int:
        return sum(p.numel() for chunk in self.model for p in chunk.parameters())

    # --- build ------------------------------------------------------------------------------------------------------
    def build(self, initial_weights: Optional[Dict[str, torch.Tensor]] = None) -> None:
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, ParamKey, ParamWithNamePredicate, get_megatron_optimizer

        from mega_depth.megatron.builder import build_model_chunks, load_full_state, transformer_impl
        from mega_depth.megatron.ddp import DistributedDataParallel
        from mega_depth.model.state_dict_adapter import is_expert_param

        cfg, p, t = self.cfg, self.cfg.parallel, self.cfg.training
        if cfg.model.transformer_impl is None and torch.cuda.is_available() and transformer_impl(cfg) == "local" \
                and self.rank == 0:
            print("the local spec, with torch SDPA core attention (Transformer Engine is not importable, or "
                  f"--residual {cfg.residual.mechanism} cannot run on its fused norm+QKV projection)", flush=True)
        chunks = build_model_chunks(cfg)
        for chunk in chunks:  # experts in their own grad buffers and optimizer at every EP size, EP 1 included:
            for name, param in chunk.named_parameters():  # the optimizer state then reshards over EP
                if is_expert_param(name):
                    param.allreduce = False
        if initial_weights is not None:
            load_full_state(chunks, initial_weights, cfg)
        if torch.cuda.is_available():
            for c in chunks:
                c.cuda(torch.cuda.current_device())
        tconfig = chunks[0].config
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=p.use_distributed_optimizer)
        # --cuda-graph-impl local: DDP made on the stream the step is captured on (megatron/step_graph.StepGraph)
        graph_stream = self._graph_stream()
        with torch.cuda.stream(graph_stream) if graph_stream is not None else contextlib.nullcontext():
            self.model = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=c,
                                                  disable_bucketing=(i > 0)) for i, c in enumerate(chunks)]
        if graph_stream is not None:
            torch.cuda.current_stream().wait_stream(graph_stream)
        self.mechanism = getattr(chunks[0].decoder, "mechanism", None)
        from mega_depth.megatron.moe_metrics import RoutingMetrics

        self.routing = RoutingMetrics.for_model(cfg, chunks, device())
        opt_config = OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, bf16=t.bf16,
            params_dtype=torch.bfloat16 if t.bf16 else torch.float32,
            use_distributed_optimizer=p.use_distributed_optimizer)
        rule = cfg.decoder_config().mechanism()  # the weight-decay rule: Megatron's, plus each mechanism's own choices
        no_decay = ParamKey(with_name_predicate=ParamWithNamePredicate(
            name="mega_depth_no_weight_decay", fn=lambda param, name: not rule.weight_decay_applies(name, param)))
        distopt_state.apply()  # a distributed optimizer's resume without TE or apex (megatron/distopt_state.py)
        self.optimizer = get_megatron_optimizer(opt_config, self.model, config_overrides={no_decay: {"wd_mult": 0.0}})
        # Without TE or apex: the grad norm and its clip on the device (no sync in the step), torch's fused AdamW
        grad_norm.apply()
        grad_norm.use_fused_adamw(self.optimizer)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        if graph_stream is not None:  # the step's forward and backward as one CUDA graph
            from mega_depth.megatron.step_graph import StepGraph

            self.step_graph = StepGraph(t.cuda_graph_warmup_steps, device(), stream=graph_stream)
        tconfig.finalize_model_grads_func = finalize_model_grads
        tconfig.grad_scale_func = self.optimizer.scale_loss
        tconfig.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        # No grad_sync_func: without overlap_grad_reduce, finalize_model_grads reduces every chunk once (as
        # Megatron-LM sets it only with --overlap-grad-reduce). A second, early reduce from the interleaved schedule
        # scaled the grads by 1/DP twice: harmless for dense weights (a sum of equal replicas), half for the
        # experts where the expert data-parallel group is smaller than DP.

    def _graph_stream(self) -> Optional["torch.cuda.Stream"]:
        """The stream of --cuda-graph-impl local's captured step; None without it."""
        if self.cfg.training.cuda_graph_impl != "local":
            return None
        if not torch.cuda.is_available():
            raise ConfigError("--cuda-graph-impl local captures the step as a CUDA graph and needs a GPU; drop it "
                              "on this machine")  # (the trainer's one-line error, exit status 2)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # (the weights reached the GPU on the current stream)
        return stream

    @property
    def modules(self):
        return [getattr(m, "module", m) for m in self.model]

    # --- step -------------------------------------------------------------------------------------------------------
    def _schedule(self, microbatches: List[dict], forward_only: bool, poison: bool = False) -> float:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from mega_depth.megatron.context_parallel import split_batch
        from mega_depth.megatron.pipeline import pipelines_of

        cp, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
        batches = [to_device(split_batch(b, cp, cp_rank)) for b in microbatches]
        cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None

        def loss_func(loss_mask, output_tensor):
            # Under CP: this rank's share of the micro-batch's token mean (Megatron's schedule multiplies it by CP
            # and DDP averages over DP x CP, so the gradients are those of the whole sequence's mean)
            loss = token_mean_loss(output_tensor, loss_mask, poison, cp_group)
            # clone: the schedule divides the returned loss in place by the number of micro-batches
            return loss, {"lm loss": loss.detach().clone()}

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            output = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
            return output, partial(loss_func, batch["loss_mask"])

        def forward_backward(batches):  # (the Python that a captured step runs once, at its capture)
            for pipe in pipelines_of(self.model):
                pipe.start_step()
            iterators = [iter(batches) for _ in self.model]
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=self.model if len(self.model) > 1 else self.model[0], num_microbatches=len(batches),
                seq_length=self.cfg.model.seq_length, micro_batch_size=self.cfg.training.micro_batch_size,
                forward_only=forward_only)

        # a poisoned step (the NaN policy's test) and evaluation run eagerly beside the graph
        graphed = self.step_graph is not None and not forward_only and not poison
        losses = self.step_graph.step(batches, forward_backward) if graphed else forward_backward(batches)
        # The step's mean loss on every rank: averaged over micro-batches on the last stage, summed over CP (the
        # shares of one sequence's mean), then averaged over DP.
        reporter = parallel_state.is_pipeline_last_stage(ignore_virtual=True) and \
            parallel_state.get_tensor_model_parallel_rank() == 0
        value = torch.zeros(1, dtype=torch.float64, device=device())
        if reporter and losses:
            value = torch.stack([l["lm loss"].double() for l in losses]).mean().reshape(1)
        torch.distributed.all_reduce(value)
        with intended("the step's loss, for logging and the NaN policy"):  # the step's one host sync
            return float(value.item()) / parallel_state.get_data_parallel_world_size()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def forward_backward(self, microbatches, poison: bool = False) -> float:
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.routing is not None:
            self.routing.add_microbatches(len(microbatches))
        return self._schedule(microbatches, forward_only=False, poison=poison)

    def update(self):
        """(grad norm, applied): the norm a device scalar (the trainer reads it where it logs: no sync in the
        optimizer step)."""
        update_ok, norm, _ = self.optimizer.step()
        if update_ok:
            self.scheduler.step(increment=1)
        return (norm if norm is not None else float("nan")), bool(update_ok)

    def discard(self) -> None:
        for m in self.model:  # the next step starts from zero grads anyway; drop the poisoned ones now
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

    def evaluate(self, microbatches) -> float:
        for m in self.model:
            m.eval()
        try:
            with torch.no_grad():
                return self._schedule(microbatches, forward_only=True)
        finally:
            for m in self.model:
                m.train()

    def moe_metrics(self):
        """Collective: the routing since the last call (megatron/moe_metrics.py), or None for a dense model."""
        return self.routing.read() if self.routing is not None else None

    def heatmap_figures(self, microbatches):
        """Collective: a forward-only probe of a whole step (interleaved schedules need every micro-batch); the
        last micro-batch's weights of every rank's layers, merged on rank 0."""
        from mega_depth.model.base import Recorder

        if self.mechanism is None:
            return None
        self.mechanism.recorder = recorder = Recorder()
        try:
            self.evaluate(microbatches)
        finally:
            self.mechanism.recorder = None
        return self.gather_figures(recorder.figures)

    # --- checkpoints ------------------------------------------------------------------------------------------------
    def _sharded_state(self, is_loading: bool = False) -> dict:
        model_sd = {f"model{i}": m.sharded_state_dict() for i, m in enumerate(self.modules)}
        flat = {}
        for sd in model_sd.values():
            flat.update(sd)
        out = dict(model_sd)
        out["optimizer"] = self.optimizer.sharded_state_dict(
            flat, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        return out

    def _rng_path(self, ckpt_dir: str) -> str:
        from megatron.core import parallel_state as ps

        cp_rank = ps.get_context_parallel_rank()
        return os.path.join(ckpt_dir, "rng", f"pp{ps.get_pipeline_model_parallel_rank()}_"
                                             f"tp{ps.get_tensor_model_parallel_rank()}"
                                             + (f"_cp{cp_rank}" if cp_rank else "") + ".pt")

    def save_files(self, tmp_dir: str, step: int) -> None:
        from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

        from mega_depth.checkpoint import dist_writer

        dist_writer.install()  # megatron-core's bucket writes on this process's threads, not in forked processes
        sd = self._sharded_state()
        sd["common"] = {"step": step, "scheduler": scheduler_state(self.scheduler)}
        dist_checkpointing.save(sd, tmp_dir)
        # RNG per (pp, tp) rank, outside the dist-checkpoint (whose objects unpickle arbitrary code on load).
        if parallel_state.get_data_parallel_rank() == 0:
            path = self._rng_path(tmp_dir)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(rng.capture(tensor_parallel.get_cuda_rng_tracker()), path)

    def load(self, ckpt_dir: str, meta: dict) -> int:
        from megatron.core import dist_checkpointing, tensor_parallel

        from mega_depth.checkpoint.rules import CheckpointError

        distributed = self.cfg.parallel.use_distributed_optimizer
        saved_distributed = meta.get("config", {}).get("parallel", {}).get("use_distributed_optimizer", distributed)
        if bool(saved_distributed) != distributed:  # the two optimizers lay out their state and groups differently
            how = "with" if saved_distributed else "without"
            raise CheckpointError(
                f"{ckpt_dir} was saved {how} --use-distributed-optimizer, and this run's optimizer cannot read that "
                f"optimizer state: resume {how} it, or keep only its weights for a new optimizer (python "
                f"tools/convert_from_hf.py --hf {ckpt_dir} --save NEW, then --load NEW)")
        saved = {"cp": 1, **meta.get("layout", {})}  # checkpoints from before context parallelism: CP 1
        same_layout = all(saved.get(k) == v for k, v in self.layout().items())
        with warnings.catch_warnings():  # megatron-core 0.16.1's own use of torch APIs it has yet to move off
            for message in (".*`load_state_dict` is deprecated", ".*Please use DTensor instead"):
                warnings.filterwarnings("ignore", message=message, category=FutureWarning)
            loaded = dist_checkpointing.load(self._sharded_state(is_loading=True), ckpt_dir)
        for i, module in enumerate(self.modules):
            module.load_state_dict(loaded[f"model{i}"])
        # Megatron's param groups carry max_lr / min_lr, which its scheduler reads before its own and the optimizer
        # state brings back: under --override-opt-param-scheduler this run's bounds stand (Megatron-LM #1138)
        bounds = [{k: g[k] for k in ("max_lr", "min_lr") if k in g} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(loaded["optimizer"])
        if self.cfg.training.override_opt_param_scheduler:
            for group, own in zip(self.optimizer.param_groups, bounds):
                group.update(own)
        common = loaded["common"]
        load_scheduler_state(self.scheduler, common["scheduler"], ckpt_dir)
        rng_file = self._rng_path(ckpt_dir)
        if same_layout and os.path.isfile(rng_file):  # a resharded run reseeds instead
            rng.restore(torch.load(rng_file, map_location="cpu", weights_only=True),
                        tensor_parallel.get_cuda_rng_tracker())
        return int(common["step"])

    def close(self) -> None:
        from mega_depth.training.backends.startup import stop_megatron

        self.step_graph = None  # the captured graph and its memory pool go with it
        stop_megatron(self._megatron_groups)
