"""What the trainer tells its user: the start-up summary, the per-rank memory estimate and the per-interval line.

A Megatron-LM user reads at a glance: the model (parameters, the mixing's share, FLOPs per token), the layout, the
data (tokens, epochs), where the outputs go; then per log interval the interval's average ms/step and tokens/s,
% done, ETA, memory and, on a GPU, MFU.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import List, Optional

from mega_depth.config import Config
from mega_depth.training.flops import flops_per_token


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class ModelCounts:
    parameters: int  # unique parameters (a tied embedding counted once)
    mixing: int  # the depth mixing's own
    flops_per_token: float  # training (forward + backward)


def model_counts(cfg: Config, vocab_size: int) -> ModelCounts:
    """Counted on the plain decoder built on the meta device (no memory, any size): the same parameters as the
    Megatron model's (tests/integration/test_megatron_model.py checks the two agree)."""
    import torch

    from mega_depth.model.decoder import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg.decoder_config(vocab_size))
    mechanism = model.model.mechanism
    params = dict(model.named_parameters())  # tied weights appear once
    m = cfg.model
    return ModelCounts(sum(p.numel() for p in params.values()),
                       sum(p.numel() for n, p in params.items() if mechanism.owns(n)),
                       flops_per_token(m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn_size,
                                       vocab_size, m.seq_length, model.cfg.active_ffn_widths()))


# ----------------------------------------------------------------------------------------------------------------
# The memory a rank needs
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    gradients: float
    optimizer: float
    activations: float  # per rank at the pipeline's peak (micro-batches in flight)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def memory_estimate(cfg: Config, parameters_on_rank: int, dp: int, zero_stage: int, depth_state_units: float,
                    world_size: int) -> MemoryEstimate:
    """Bytes one rank needs. Weights, gradients and Adam's state follow from the parameters this rank holds:
    fp32 weights (bf16: bf16 weights plus fp32 masters in the optimizer), fp32 gradients, two fp32 moments; the
    distributed optimizer and ZeRO-1 divide the optimizer state by DP, ZeRO-2 the gradients too, ZeRO-3 the
    weights too. Activations: Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer
    Models", per layer s*b*h*(34 + 5*a*s/h) bytes at 16 bits with TP t (the 5as/h term dropped with SDPA's fused
    attention, which keeps no score matrix; divided by t with sequence parallelism, else 10 + 24/t), full
    recomputation keeping each layer's input only; 1F1B keeps up to PP micro-batches in flight on the first stage
    (interleaved: x (1 + (PP-1)/(PP*V))). The depth mixing adds the state it carries across layers
    (`depth_state_units` x d per token, per micro-batch in flight, split by TP under sequence parallelism) less the
    one hidden state the layer formula already counts as the layer's input: the standard residual adds nothing.
    MoE layers replace the MLP's share with their own (`_moe_extra`)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    bf16 = t.bf16
    weights = parameters_on_rank * (2 if bf16 else 4)
    gradients = parameters_on_rank * 4
    optimizer = parameters_on_rank * (12 if bf16 else 8)
    if p.use_distributed_optimizer or zero_stage >= 1:
        optimizer /= dp
    if zero_stage >= 2:
        gradients /= dp
    if zero_stage >= 3:
        weights /= dp
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    # under context parallelism a rank holds s / CP tokens of every sequence (all-gather CP keeps only local K, V)
    s, b, h, a = m.seq_length // p.context_parallel_size, t.micro_batch_size, m.hidden_size, m.num_attention_heads
    scores = 0.0 if m.attention_backend == "sdpa" else 5 * a * s / h
    moe = _moe_extra(cfg)  # MoE under TP runs with SP (config validation): the SP branch holds it
    if p.sequence_parallel:
        per_layer = s * b * h * (34 + scores + moe) / tp
    else:
        per_layer = s * b * h * (10 + 24 / tp + scores / tp + moe)
    if p.recompute_granularity == "full":
        per_layer = 2 * s * b * h / (tp if p.sequence_parallel else 1)
    element = 1.0 if bf16 else 2.0  # the formula counts 16-bit activations
    layers = m.num_layers / pp
    num_microbatches = cfg.num_microbatches(world_size)
    in_flight = min(pp, num_microbatches)
    if cfg.virtual_pipeline_size:
        in_flight *= 1 + (pp - 1) / (pp * cfg.virtual_pipeline_size)
    carried = max(depth_state_units - 1, 0.0) / (tp if p.sequence_parallel else 1)
    depth_state = carried * s * b * h * (2 if bf16 else 4)
    activations = (per_layer * element * layers + depth_state) * in_flight
    return MemoryEstimate(weights, gradients, optimizer, activations)


def _moe_extra(cfg: Config) -> float:
    """What the MoE layers add to the layer formula's 34 (per layer, averaged over layers), in units of s*b*h bytes.

    The formula's MLP share (19) is a 16-bit SwiGLU of the dense width f: its input 2, fc1's gate and up outputs
    4f/h, fc2's input 2f/h and the dropout mask 1 (at f = 8h/3 exactly Korthikanti's 4h GeLU MLP). An MoE layer
    keeps the router's input 2, the k permuted copies of each token that the experts read 2k, the experts' and the
    shared expert's SwiGLU intermediates 6 x (k x f_expert + f_shared) / h and the mask 1. Expert parallelism moves
    tokens between ranks but, balanced, leaves k copies per token on each; expert TP splits the widths as SP splits
    the tokens."""
    dc = cfg.decoder_config()
    if not dc.num_experts:
        return 0.0
    h, k, dense = dc.hidden_size, dc.moe_router_topk, dc.ffn_hidden_size
    extra = [2 * k + 6 * (width - dense) / h
             for i, width in enumerate(dc.active_ffn_widths()) if dc.is_moe_layer(i)]
    return sum(extra) / dc.num_layers


def memory_lines(estimate: MemoryEstimate) -> List[str]:
    e = estimate
    return [f"memory per rank (estimate): {_gib(e.total)} = weights {_gib(e.weights)} + gradients "
            f"{_gib(e.gradients)} + optimizer {_gib(e.optimizer)} + activations {_gib(e.activations)} (Korthikanti "
            "et al. 2022 for the layers, plus the depth state the mechanism carries)"]


# ----------------------------------------------------------------------------------------------------------------
# The start-up summary
# ----------------------------------------------------------------------------------------------------------------


def summary_lines(cfg: Config, counts: ModelCounts, layout: dict, sampler_shape, world_size: int,
                  data_tokens: Optional[int], start: int, evaluating: bool) -> List[str]:
    m, r, t, ck = cfg.model, cfg.residual, cfg.training, cfg.checkpoint
    mbs, nmb, dp, _ = sampler_shape
    gbs = mbs * nmb * dp
    options = {k: v for k, v in cfg.decoder_config().residual_values().items() if k != "residual"}
    mechanism = r.mechanism + (f" ({', '.join(f'{k}={v}' for k, v in options.items())})" if options else "")
    share = counts.mixing / counts.parameters if counts.parameters else 0.0
    steps = t.train_iters - start
    tokens_per_step = gbs * m.seq_length
    lines = [
        f"model: --residual {mechanism}",
        f"  {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads ({m.query_groups} key-value "
        f"groups), ffn {m.ffn_size}, sequence {m.seq_length}, vocabulary {cfg.model.vocab_size}",
        f"  parameters {_count(counts.parameters)} ({counts.parameters:,}), of which the depth mixing "
        f"{counts.mixing:,} ({share:.3%}); {counts.flops_per_token / 1e6:,.1f} MFLOPs per token (training)",
        (f"layout: one SPMD program over {layout['devices']} device(s), mesh data {layout['mesh'][0]} x fsdp "
         f"{layout['mesh'][1]}" if "mesh" in layout else  # the XLA trainer
         f"layout: world {world_size} = TP {layout.get('tp', 1)}"
         + (f" x CP {layout['cp']}" if layout.get("cp", 1) > 1 else "")
         + f" x PP {layout.get('pp', 1)} x DP {layout.get('dp', dp)}")
        + (f" (virtual stages {cfg.virtual_pipeline_size})" if cfg.virtual_pipeline_size else "")
        + (" + sequence parallel" if cfg.parallel.sequence_parallel else "")
        + (f" | DeepSpeed {os.path.basename(t.deepspeed_config or '')}" if t.deepspeed else "")
        + f" | micro-batch {mbs} x {nmb} micro-batches x DP {dp} = global batch {gbs} ({tokens_per_step:,} "
        "tokens per step)",
    ]
    planned = steps * tokens_per_step
    if data_tokens is None:
        lines.append(f"data: mock (random tokens); {steps} steps ({start} done) take {planned:,} tokens")
    else:
        epochs = planned / data_tokens if data_tokens else float("inf")
        lines.append(f"data: {len(cfg.data.data_path or [])} dataset path(s), training split {data_tokens:,} tokens; "
                     f"{steps} steps ({start} done) take {planned:,} tokens = {epochs:.2f} epochs")
    every = f"every {cfg.data.eval_interval} steps and " if cfg.data.eval_interval else ""
    lines.append(f"evaluation: {every}at the last step ({cfg.data.eval_iters} batches)" if evaluating
                 else "evaluation: none")
    out = cfg.logging.output_dir
    lines.append(f"outputs: {out}/ (metrics.jsonl, config.yaml"
                 + (", tensorboard/" if cfg.logging.tensorboard else "") + ", heatmaps/)"
                 + (f"; W&B project {cfg.logging.wandb_project}" if cfg.logging.wandb_project else ""))
    if ck.save:
        every = f"every {ck.save_interval} steps, " if ck.save_interval else ""
        lines.append(f"checkpoints: {ck.save}/ ({every}at the end and on SIGTERM; keeps the last {ck.keep_last})")
    else:
        lines.append("checkpoints: none (no --save)")
    return lines


# ----------------------------------------------------------------------------------------------------------------
# The per-interval line
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class IntervalMeter:
    """Steps and seconds since the last console line, and over the run (for the ETA)."""

    total_steps: int
    tokens_per_step: int
    flops_per_step: float
    peak_flops: Optional[float]  # the accelerator's, per device (None: no MFU, e.g. on a CPU)
    world_size: int
    steps: int = 0
    seconds: float = 0.0
    _later: List[float] = field(default_factory=lambda: [0, 0.0])  # steps and seconds after the run's first step
    _first_seen: bool = False

    def add(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        if self._first_seen:  # the first step compiles and warms up: not a measure of the rest
            self._later[0] += 1
            self._later[1] += seconds
        self._first_seen = True

    def line(self, done: int) -> str:
        """The interval's averages and the run's ETA; starts the next interval."""
        ms = 1000 * self.seconds / max(self.steps, 1)
        tokens_per_s = self.tokens_per_step * self.steps / self.seconds if self.seconds else 0.0
        later_steps, later_seconds = self._later
        per_step = later_seconds / later_steps if later_steps else self.seconds / max(self.steps, 1)
        eta = datetime.timedelta(seconds=round(per_step * (self.total_steps - done)))
        parts = [f"{ms:,.1f} ms/step", f"{tokens_per_s:,.0f} tokens/s"]
        if self.peak_flops and self.seconds:
            mfu = self.flops_per_step * self.steps / self.seconds / (self.peak_flops * self.world_size)
            parts.append(f"MFU {mfu:.1%}")
        parts.append(f"ETA {eta}")
        self.steps, self.seconds = 0, 0.0
        return " | ".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# Mixture of experts: what the routers did over a logging interval
# ----------------------------------------------------------------------------------------------------------------


def load_imbalance(counts: List[float]) -> float:
    """The busiest expert's tokens over the mean (1: perfectly balanced; E: every token to one expert)."""
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean > 0 else float("nan")


def routing_summary(routing: dict) -> dict:
    """metrics.jsonl's MoE fields: the load-balancing loss averaged over MoE layers (/ its coefficient, as
    Megatron-LM logs it) and the worst layer's expert-load imbalance."""
    out = {"moe_load_max_over_mean": max(load_imbalance(c) for c in routing["tokens_per_expert"].values())}
    losses = routing.get("load_balancing_loss")
    if losses:
        out["moe_load_balancing_loss"] = sum(losses.values()) / len(losses)
    return out
