"""Typed configuration: model, residual mechanism, parallel layout, training. Validated once, at start-up.

Flag names follow Megatron-LM where Megatron-LM has the flag, so that users keep their muscle memory.
Every invalid combination fails in `validate()` with a message that names the fix; nothing is left to fail
deep inside a step.
"""

from __future__ import annotations

import argparse
import importlib.util
import dataclasses
import os
from dataclasses import dataclass, field
from typing import List, Optional

from mega_depth.model.config import DecoderConfig, ResidualConfig, architecture_flags, option_flag
from mega_depth.model.registry import MECHANISMS, mechanism_class

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
ATTENTION_BACKENDS = ("sdpa", "unfused")
MIXING_IMPLS = ("eager", "compiled", "triton")


class ConfigError(ValueError):
    """A configuration that cannot work. The message says what to change."""


def _f(default, help: str, choices=None, aliases=()):
    """A config field with its --help line (and its allowed values: checked once, in validate(); `aliases`: other
    spellings of its flag, Megatron-LM's where ours differs)."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if aliases:
        metadata["aliases"] = tuple(aliases)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig(architecture_flags()):
    """The `model:` section: the architecture flags, generated from the one record of the model (DecoderConfig:
    --num-layers, --num-experts, ...; `decoder_config()` reads them), and the training switches below, which a
    run may change on resume."""
    seq_length: int = _f(64, "tokens per training sample")
    init_method_std: float = _f(0.02, "std of the normal initialisation of the weight matrices")
    transformer_impl: Optional[str] = _f(None, "Megatron layer spec: local (torch ops) or transformer_engine "
                                               "(default: transformer_engine on a GPU where it imports, else local)",
                                         (None,) + TRANSFORMER_IMPLS)
    attention_backend: str = _f("sdpa", "core attention of the local spec: sdpa (torch's fused kernels) or unfused "
                                        "(Megatron's)", ATTENTION_BACKENDS)
    fused_single_qkv_rope: bool = _f(False, "Megatron's fused RoPE over the single QKV tensor (mechanisms that "
                                            "need separate q/k/v refuse it)")
    mixing_impl: Optional[str] = _f(None, "depth-mixing implementation: eager (mixing.py, the reference), compiled "
                                          "(torch.compile'd twins) or triton (fused kernels; default on a GPU where "
                                          "triton imports, else eager)", (None,) + MIXING_IMPLS)
    mixing_recompute: bool = _f(True, "on the fast paths, recompute in backward what the mixing makes instead of "
                                      "keeping it (activation memory near the baseline's)")
    compile_layers: bool = _f(False, "torch.compile every layer whole, mixing included (eager stays the "
                                     "reference)")
    # Mixture-of-experts training switches (Megatron-LM's flags; the experts themselves are architecture flags)
    moe_router_bias_update_rate: float = _f(1e-3, "the expert bias's step per optimizer step")
    moe_router_load_balancing_type: str = _f("aux_loss", "the load-balancing loss: aux_loss (over the micro-batch), "
                                                         "seq_aux_loss (per sequence) or none",
                                             ("aux_loss", "seq_aux_loss", "none"))
    moe_aux_loss_coeff: float = _f(0.0, "weight of the load-balancing loss (Megatron-LM's default 0: off)")
    moe_token_dispatcher_type: str = _f("alltoall", "how tokens reach their experts' ranks: alltoall (each token "
                                                    "to its experts' ranks) or allgather (every token to every "
                                                    "expert rank)", ("alltoall", "allgather"))
    moe_grouped_gemm: bool = _f(False, "the experts as one grouped GEMM (GPU: Transformer Engine's or Megatron's "
                                       "grouped_gemm)")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = _f(1, "tensor-parallel size (TP)")
    pipeline_model_parallel_size: int = _f(1, "pipeline stages (PP)")
    num_layers_per_virtual_pipeline_stage: Optional[int] = _f(None, "layers per virtual stage: the interleaved "
                                                                    "1F1B schedule (default: plain 1F1B)")
    context_parallel_size: int = _f(1, "context-parallel size (CP): each sequence split over CP ranks in 2 x CP "
                                       "load-balanced chunks; attention all-gathers K and V")
    sequence_parallel: bool = _f(False, "Megatron's sequence parallelism (needs TP > 1)")
    expert_model_parallel_size: int = _f(1, "expert-parallel size (EP): the experts of each MoE layer split over EP "
                                            "ranks, inside the data-parallel ones")
    expert_tensor_parallel_size: Optional[int] = _f(None, "tensor-parallel size of each expert (default: TP)")
    use_distributed_optimizer: bool = _f(False, "shard the optimizer state over data-parallel ranks (ZeRO-1)")
    recompute_granularity: Optional[str] = _f(None, "activation recomputation: full (whole layers) or selective "
                                                    "(attention's core); default none", (None, "full", "selective"))
    recompute_method: str = _f("uniform", "with full recompute: uniform (groups of layers) or block (the first "
                                          "N layers of each stage)", ("uniform", "block"))
    recompute_num_layers: int = _f(1, "with full recompute: layers per group (uniform) or per stage (block)")
    vp_cache: bool = _f(True, "with virtual stages, send only the depth-state entries the receiving rank does not "
                              "hold yet")


@dataclass
class TrainingConfig:
    micro_batch_size: int = _f(2, "samples per micro-batch per data-parallel rank")
    global_batch_size: Optional[int] = _f(None, "samples per optimizer step (default: micro-batch x data-parallel "
                                                "size; more means gradient accumulation)")
    train_iters: int = _f(10, "optimizer steps in all (a resumed run continues to this step)")
    exit_interval: Optional[int] = _f(None, "save and stop once the step is a multiple of this")
    lr: float = _f(1e-3, "peak learning rate")
    min_lr: float = _f(0.0, "learning rate at the end of the decay")
    lr_decay_style: str = _f("cosine", "learning-rate decay after warm-up", LR_DECAY_STYLES)
    lr_warmup_iters: int = _f(0, "linear warm-up steps")
    lr_decay_iters: Optional[int] = _f(None, "steps over which the learning rate decays (default: --train-iters)")
    lr_wsd_decay_iters: Optional[int] = _f(None, "WSD: length of the final decay (default: 10% of the decay steps, at "
                                                       "most the steps after the warm-up)")
    lr_wsd_decay_style: str = _f("linear", "WSD: shape of the final decay",
                                 ("linear", "cosine", "exponential", "minus_sqrt"))
    override_opt_param_scheduler: bool = _f(False, "on resume, take the learning-rate schedule from these flags, not "
                                                   "from the checkpoint (to extend --train-iters and its decay)",
                                            aliases=("--override-opt_param-scheduler",))
    use_checkpoint_opt_param_scheduler: bool = _f(False, "on resume, keep the checkpoint's learning-rate schedule "
                                                         "whatever these flags say",
                                                  aliases=("--use-checkpoint-opt_param-scheduler",))
    weight_decay: float = _f(0.1, "AdamW weight decay (norm gains and mixing parameters the mechanism exempts: 0)")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.95, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this (0: no clipping)")
    seed: int = _f(1234, "seed of the keyed initialisation, dropout and data order")
    bf16: bool = _f(False, "bf16 mixed precision (fp32 master weights)")
    on_nan: str = _f("stop", "a non-finite loss: stop (exit 3) or skip the update", ("stop", "skip"))
    cuda_graph_impl: str = _f("none", "local: each training step's forward and backward captured once as one CUDA "
                                      "graph and replayed (Megatron-LM's flag; one process on a GPU, with "
                                      "--cuda-graph-scope full_iteration)", ("none", "local"))
    cuda_graph_scope: str = _f("full_iteration", "what --cuda-graph-impl local captures: full_iteration (the step's "
                                                 "forward and backward; Megatron-LM's per-layer scopes are not "
                                                 "offered: the mixing's state crosses layers)", ("full_iteration",))
    cuda_graph_warmup_steps: int = _f(3, "eager steps before the step is captured (Megatron-LM's default)")
    deepspeed: bool = _f(False, "train with the DeepSpeed engine (ZeRO 0-3, data parallel only)")
    deepspeed_config: Optional[str] = _f(None, "DeepSpeed JSON config (launch/ds_configs/zero*.json)")
    dry_run: bool = _f(False, "size the model on the meta device, print the start-up summary and the per-rank memory "
                              "estimate (at the layout's world, in one process), then "
                              "exit without a step")

    def check(self) -> None:
        t = self
        _check(t.micro_batch_size >= 1, f"--micro-batch-size {t.micro_batch_size} must be >= 1")
        _check(t.global_batch_size is None or t.global_batch_size >= 1,
               f"--global-batch-size {t.global_batch_size} must be >= 1 (a multiple of --micro-batch-size x the "
               "data-parallel size), or left out for one micro-batch per rank")
        _check(t.train_iters >= 1, "--train-iters must be >= 1")
        _check(t.lr > 0, f"--lr {t.lr} must be positive")
        _check(0 <= t.min_lr <= t.lr, f"--min-lr {t.min_lr} must lie in [0, --lr {t.lr}]")
        _check(t.weight_decay >= 0, f"--weight-decay {t.weight_decay} must be >= 0")
        _check(t.clip_grad >= 0, f"--clip-grad {t.clip_grad} must be >= 0 (0 disables clipping)")
        _check(0 <= t.adam_beta1 < 1 and 0 <= t.adam_beta2 < 1,
               f"--adam-beta1 {t.adam_beta1} and --adam-beta2 {t.adam_beta2} must lie in [0, 1)")
        _check(t.adam_eps > 0, f"--adam-eps {t.adam_eps} must be positive")
        _check(t.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0")
        _check(not (t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler),
               "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler contradict each other; pass "
               "one (this run's schedule, or the checkpoint's)")
        decay = t.lr_decay_iters or t.train_iters
        _check(t.lr_warmup_iters < decay,
               f"--lr-warmup-iters {t.lr_warmup_iters} must be below the decay length ({decay}: --lr-decay-iters, "
               "else --train-iters)")
        _check(t.lr_wsd_decay_iters is None or 1 <= t.lr_wsd_decay_iters <= decay - t.lr_warmup_iters,
               f"--lr-wsd-decay-iters {t.lr_wsd_decay_iters} must lie in 1..{decay - t.lr_warmup_iters} (the decay "
               f"length {decay} less the {t.lr_warmup_iters} warm-up steps: WSD's final decay ends with the decay), "
               "or be left out for 10% of the decay")
        _check(t.exit_interval is None or t.exit_interval >= 1, "--exit-interval must be >= 1")


@dataclass
class DataConfig:
    mock_data: bool = _f(False, "random tokens instead of --data-path (tests, benchmarks)")
    data_path: Optional[List[str]] = _f(None, "Megatron indexed-dataset prefixes: PREFIX [PREFIX ...] or W1 PREFIX1 "
                                              "W2 PREFIX2 ... (tools/preprocess_data.py makes them)")
    split: str = _f("969,30,1", "training,validation,test weights of each dataset's documents")
    tokenizer_model: Optional[str] = _f(None, "sentencepiece model the data was made with; sets the vocabulary")
    eval_interval: Optional[int] = _f(None, "evaluate on the validation split every N steps (the last step is "
                                            "always evaluated where a validation split exists)")
    eval_iters: int = _f(10, "validation batches per evaluation (0: none)")
    data_cache_path: Optional[str] = _f(None, "where Megatron caches its sample indexes (default: in memory)")

    def check(self) -> None:
        d = self
        _check(d.mock_data != bool(d.data_path),
               "give exactly one data source: --data-path PREFIX... (see tools/preprocess_data.py) or --mock-data")
        if d.data_path:
            _check(d.tokenizer_model is not None, "--data-path needs --tokenizer-model (the tokenizer that made it)")
        if d.tokenizer_model is not None:
            _check(os.path.isfile(d.tokenizer_model),
                   f"--tokenizer-model {d.tokenizer_model} does not exist; train one with tools/train_tokenizer.py")
        _check(d.eval_interval is None or d.eval_interval >= 1, "--eval-interval must be >= 1")
        _check(d.eval_iters >= 0, "--eval-iters must be >= 0 (0: no evaluation)")


@dataclass
class CheckpointConfig:
    save: Optional[str] = _f(None, "folder to save checkpoints into (iter_N/ inside; one run at a time)")
    load: Optional[str] = _f(None, "checkpoint to resume from: a --save folder (newest intact checkpoint) or one "
                                   "iter_N; a missing or empty folder starts from scratch")
    save_interval: Optional[int] = _f(None, "save every N steps (the last step and SIGTERM always save)")
    keep_last: int = _f(3, "this run's checkpoints kept in --save (its last verified one too, until a newer one "
                             "verifies)")
    overwrite_save: bool = _f(False, "let a run started from scratch save beside another run's checkpoints")
    use_checkpoint_args: bool = _f(False, "take the model and mechanism from the --load checkpoint (Megatron-LM's "
                                          "flag): fine-tune an imported model without its original --config")

    def check(self) -> None:
        c = self
        _check(c.save_interval is None or c.save is not None, "--save-interval needs --save DIR")
        _check(c.save_interval is None or c.save_interval >= 1, "--save-interval must be >= 1")
        _check(c.keep_last >= 1, "--keep-last must be >= 1")
        _check_folder("--save", c.save)


@dataclass
class LoggingConfig:
    output_dir: str = _f("runs/default", "metrics.jsonl, config.yaml, TensorBoard events and heatmaps go here")
    overwrite_output_dir: bool = _f(False, "let a new run replace another run's metrics, config.yaml and "
                                           "TensorBoard events in --output-dir")
    log_interval: int = _f(1, "print a console line every N steps (averages over the interval)")
    tensorboard: bool = _f(True, "write TensorBoard events into --output-dir/tensorboard")
    heatmap_interval: Optional[int] = _f(None, "depth-weight heatmaps every N steps (default: at the end)")
    wandb_project: Optional[str] = _f(None, "log to Weights & Biases in this project (pip install "
                                            "'mega_depth[wandb]'; WANDB_MODE=offline writes local files)")
    wandb_exp_name: Optional[str] = _f(None, "W&B run name (default: the --output-dir folder's name)")
    wandb_save_dir: Optional[str] = _f(None, "W&B's local folder (default: --output-dir)")

    def check(self) -> None:
        log = self
        _check_folder("--output-dir", log.output_dir)
        _check(log.log_interval >= 1, "--log-interval must be >= 1")
        _check(log.heatmap_interval is None or log.heatmap_interval >= 1, "--heatmap-interval must be >= 1")
        if log.wandb_project:  # here, before any process group, so every rank fails alike (not rank 0 alone)
            _check(importlib.util.find_spec("wandb") is not None, "--wandb-project needs the wandb package: pip "
                   "install 'mega_depth[wandb]' (or pip install wandb)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def num_sublayers(self) -> int:
        return 2 * self.model.num_layers

    @property
    def virtual_pipeline_size(self) -> Optional[int]:
        p = self.parallel
        if p.num_layers_per_virtual_pipeline_stage is None:
            return None
        return self.model.num_layers // (p.pipeline_model_parallel_size * p.num_layers_per_virtual_pipeline_stage)

    def data_parallel_size(self, world_size: int) -> int:
        p = self.parallel
        return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)

    def num_microbatches(self, world_size: int) -> int:
        t = self.training
        dp = self.data_parallel_size(world_size)
        gbs = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * dp
        return gbs // (t.micro_batch_size * dp)

    def validate(self, world_size: int = 1) -> "Config":
        """Refuse every combination that cannot work, naming the fix. Returns self. Each section checks itself; the
        rules across sections (the world's factorisation, the sequence splits, experts, pipelines, DeepSpeed's
        refusals, the batch) follow, in this order (the first broken rule is the one reported)."""
        _check_model(self)
        _check_world(self, world_size)
        _check_vocab(self)
        _check_sequence_splits(self)
        _check_moe(self, world_size)
        _check_pipeline(self)
        self.training.check()
        self.data.check()
        self.checkpoint.check()
        self.logging.check()
        _check_deepspeed(self)
        _check_cuda_graph(self, world_size)
        _check_batches(self, world_size)
        mechanism_class(self.residual.mechanism).validate(self, _check)
        _check_fused_rope(self)  # after the mechanisms' refusals of the flag, which no setting lifts
        return self

    def decoder_config(self, vocab_size: Optional[int] = None) -> DecoderConfig:
        """The one record of the model, read from the `model:` flags and the mechanism (vocab_size: padded)."""
        try:
            return DecoderConfig.from_flags(self.model, self.residual, vocab_size)
        except ValueError as e:  # a flag that cannot be read (--moe-layer-freq); the message names the fix
            raise ConfigError(str(e)) from None


def _check_model(cfg: "Config") -> None:
    """The model's shape and the implementations it asks for."""
    m, r = cfg.model, cfg.residual
    _check(r.mechanism in MECHANISMS, f"unknown --residual {r.mechanism!r}; choose one of {', '.join(MECHANISMS)}")
    _check_choices(cfg)
    _check(m.num_layers >= 1 and m.hidden_size >= 1, "--num-layers and --hidden-size must be positive")
    _check(m.num_attention_heads >= 1 and m.seq_length >= 1,
           "--num-attention-heads and --seq-length must be positive")
    _check(
        m.hidden_size % m.num_attention_heads == 0,
        f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}; "
        "pick a head count that divides the hidden size",
    )
    _check(
        m.num_attention_heads % m.query_groups == 0,
        f"--num-query-groups {m.query_groups} must divide --num-attention-heads {m.num_attention_heads}",
    )
    _check(0.0 <= m.hidden_dropout < 1.0 and 0.0 <= m.attention_dropout < 1.0,
           "--hidden-dropout and --attention-dropout must lie in [0, 1)")
    if m.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise ConfigError("--transformer-impl transformer_engine needs Transformer Engine, which is not "
                              "installed; install transformer-engine or use --transformer-impl local") from None
        _check(mechanism_class(r.mechanism).runs_on_fused_norm_qkv, f"--residual {r.mechanism} feeds separate "
               "query/key/value inputs, which Transformer Engine's fused norm+QKV projection cannot take; use "
               "--transformer-impl local")
    if m.mixing_impl == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ConfigError("--mixing-impl triton needs triton (pip install triton==3.6.0, the version the "
                              "GPU's torch uses); or use --mixing-impl eager") from None


def _check_fused_rope(cfg: "Config") -> None:
    """--fused-single-qkv-rope where Megatron's fused path can run (else it asserts in the first forward)."""
    m = cfg.model
    if not m.fused_single_qkv_rope:
        return
    _check(not m.qk_layernorm, "--fused-single-qkv-rope rotates the single QKV tensor, which leaves no place for "
           "the query/key norms; add --no-qk-layernorm, or drop --fused-single-qkv-rope")
    _check(importlib.util.find_spec("transformer_engine") is not None, "--fused-single-qkv-rope runs Transformer "
           "Engine's fused QKV RoPE, and Transformer Engine is not installed; install it, or drop the flag")


def _check_world(cfg: "Config", world_size: int) -> None:
    """The world's factorisation, written once: TP x CP x PP model-parallel ranks, the rest data parallel (EP and
    expert-TP inside it: _check_moe); the heads and the FFN split over TP."""
    m, p = cfg.model, cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    _check(tp >= 1 and pp >= 1 and cp >= 1, "parallel sizes must be >= 1")
    names, sizes = ("TP x PP", f"{tp} x {pp}") if cp == 1 else ("TP x CP x PP", f"{tp} x {cp} x {pp}")
    _check(world_size % (tp * cp * pp) == 0,
           f"world size {world_size} is not divisible by {names} = {sizes}; launch a multiple of {tp * cp * pp} "
           "processes (torchrun --nproc-per-node)" + (", the rest is data parallel" if cp > 1 else ""))
    _check(m.num_attention_heads % tp == 0,
           f"--num-attention-heads {m.num_attention_heads} is not divisible by "
           f"--tensor-model-parallel-size {tp}")
    _check(m.query_groups % tp == 0,
           f"--num-query-groups {m.query_groups} is not divisible by --tensor-model-parallel-size {tp}; "
           "use a TP size that divides the key-value heads")
    _check(m.ffn_size % tp == 0, f"the FFN size {m.ffn_size} is not divisible by TP={tp}")


def _check_vocab(cfg: "Config") -> None:
    m = cfg.model
    if m.vocab_size is None and cfg.data.mock_data:
        m.vocab_size = 256
    _check(m.vocab_size is not None, "the vocabulary size comes from --tokenizer-model (or --vocab-size with "
                                     "--mock-data)")
    _check(m.vocab_size >= 2, "--vocab-size must be at least 2")


def _check_sequence_splits(cfg: "Config") -> None:
    """Sequence parallelism and context parallelism: how each sequence is cut."""
    m, p = cfg.model, cfg.parallel
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    if p.sequence_parallel:
        _check(tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
        _check(m.seq_length % tp == 0,
               f"--seq-length {m.seq_length} is not divisible by TP={tp}, which --sequence-parallel needs")
    if cp > 1:
        _check(m.seq_length % (2 * cp) == 0,
               f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size = {2 * cp} (each "
               "sequence is split into 2 x CP chunks); pick a sequence length that is")
        _check(not p.sequence_parallel or (m.seq_length // cp) % tp == 0,
               f"--sequence-parallel splits each CP rank's {m.seq_length // cp} tokens over TP={tp}; pick a "
               f"--seq-length divisible by CP x TP = {cp * tp}")
        _check(m.attention_backend == "sdpa" or m.transformer_impl == "transformer_engine",
               "--context-parallel-size needs --attention-backend sdpa (the unfused reference attention has no "
               "context parallelism)")


def _check_pipeline(cfg: "Config") -> None:
    """Pipeline stages, interleaved (virtual) stages and recomputation."""
    m, p = cfg.model, cfg.parallel
    pp = p.pipeline_model_parallel_size
    _check(m.num_layers % pp == 0,
           f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if p.num_layers_per_virtual_pipeline_stage is not None:
        v = p.num_layers_per_virtual_pipeline_stage
        _check(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        _check(v >= 1 and m.num_layers % (pp * v) == 0,
               f"--num-layers {m.num_layers} is not divisible by pipeline stages x layers per virtual stage "
               f"({pp} x {v}); change --num-layers-per-virtual-pipeline-stage")
        _check(m.num_layers // (pp * v) >= 2,
               "--num-layers-per-virtual-pipeline-stage leaves a single virtual stage per rank; drop the flag "
               "(plain 1F1B) or lower it")
    if p.recompute_granularity is not None:
        _check(p.recompute_num_layers >= 1, "--recompute-num-layers must be >= 1")
    per_chunk = p.num_layers_per_virtual_pipeline_stage or m.num_layers // pp
    n = p.recompute_num_layers
    # Megatron's own block (a mechanism that mixes no depth) checkpoints groups of exactly n layers: a last,
    # shorter group indexes past the chunk's layers (IndexError in the first step); the depth-mixing block's
    # groups end at the chunk's end
    _check(not (p.recompute_granularity == "full" and p.recompute_method == "uniform" and per_chunk % n
                and not mechanism_class(cfg.residual.mechanism).mixes_depth),
           f"--recompute-num-layers {n} does not divide the {per_chunk} layers of a pipeline chunk, which "
           f"--recompute-method uniform needs with --residual {cfg.residual.mechanism}; pick a divisor of "
           f"{per_chunk}, or --recompute-method block")


def _check_deepspeed(cfg: "Config") -> None:
    """What the DeepSpeed backend cannot run (ZeRO data parallelism only)."""
    p, t = cfg.parallel, cfg.training
    if not t.deepspeed:
        return
    _check(t.deepspeed_config is not None, "--deepspeed needs --deepspeed-config ds.json")
    _check(p.pipeline_model_parallel_size == 1,
           "the DeepSpeed engine shards data-parallel state (ZeRO) and cannot drive Megatron's pipeline "
           "schedules; use --pipeline-model-parallel-size 1 with --deepspeed, or drop --deepspeed")
    _check(not p.use_distributed_optimizer,
           "--use-distributed-optimizer is Megatron's ZeRO-1; with --deepspeed use the ZeRO stage in the "
           "DeepSpeed config instead")
    _check(p.tensor_model_parallel_size == 1 and p.context_parallel_size == 1,
           "--deepspeed trains with data parallelism (ZeRO); use the Megatron path (no --deepspeed) for "
           "tensor, context or pipeline parallelism")


def _check_cuda_graph(cfg: "Config", world_size: int) -> None:
    """What a captured step (mega_depth/megatron/step_graph.py) cannot replay, or what no test has replayed yet."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    if t.cuda_graph_impl == "none":
        return
    flag = "--cuda-graph-impl local"
    _check(t.cuda_graph_warmup_steps >= 1, f"--cuda-graph-warmup-steps {t.cuda_graph_warmup_steps} must be >= 1 "
           "(the compiles and the pointer tables' count happen in an eager step before the capture)")
    _check(not t.deepspeed, f"{flag} captures the Megatron backend's step; drop --deepspeed")
    _check(world_size == 1, f"{flag} runs one process so far (the captured collectives are untested); launch one "
           f"process, or drop {flag} for {world_size}")
    _check(p.recompute_granularity is None, f"{flag} with --recompute-granularity: Megatron's recomputation saves and "
           "restores the CUDA RNG state, which a capture cannot; drop one of them")
    _check(m.hidden_dropout == 0 and m.attention_dropout == 0, f"{flag} with dropout: Megatron's RNG tracker forks "
           "the CUDA RNG state, which a capture cannot; set --hidden-dropout 0 --attention-dropout 0")
    _check(m.attention_backend == "sdpa" and m.transformer_impl != "transformer_engine",
           f"{flag} needs the local spec with --attention-backend sdpa (the unfused attention forks the RNG state; "
           "Transformer Engine's graphs are its own)")
    _check(not m.compile_layers, f"{flag} with --compile-layers is untested; drop one of them")
    _check(not m.num_experts, f"{flag} with experts: the router's load statistics are read on the host each step; "
           "drop --num-experts or the flag")


def _check_batches(cfg: "Config", world_size: int) -> None:
    """The global batch over the data-parallel ranks, and the micro-batches interleaved pipelines need."""
    t, pp = cfg.training, cfg.parallel.pipeline_model_parallel_size
    dp = cfg.data_parallel_size(world_size)
    if t.global_batch_size is not None:
        _check(
            t.global_batch_size % (t.micro_batch_size * dp) == 0,
            f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size x data-parallel "
            f"size ({t.micro_batch_size} x {dp})",
        )
    if cfg.virtual_pipeline_size is not None:
        nmb, mechanism = cfg.num_microbatches(world_size), cfg.residual.mechanism
        _check(nmb % pp == 0,
               f"interleaved pipelines need the number of micro-batches ({nmb}) to be a multiple of "
               f"--pipeline-model-parallel-size {pp}; raise --global-batch-size")
        _check(mechanism == "standard" or nmb >= 2 * pp,
               f"interleaved pipelines with --residual {mechanism} need at least 2 x "
               f"--pipeline-model-parallel-size micro-batches per step (got {nmb}): with every micro-batch in "
               "warm-up the variable-shape p2p exchange deadlocks on this version; raise --global-batch-size")


def _check_moe(cfg: "Config", world_size: int) -> None:
    """Mixture-of-experts flags and expert parallelism (EP inside the data-parallel ranks, as Megatron lays it)."""
    m, p = cfg.model, cfg.parallel
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    if not m.num_experts:
        _check(m.num_experts is None, f"--num-experts {m.num_experts} must be >= 1 (or left out: dense MLPs)")
        _check(ep == 1, f"--expert-model-parallel-size {ep} needs experts: add --num-experts")
        return
    _check(m.num_experts >= 1, f"--num-experts {m.num_experts} must be >= 1")
    _check(1 <= m.moe_router_topk <= m.num_experts,
           f"--moe-router-topk {m.moe_router_topk} must lie in 1..--num-experts ({m.num_experts})")
    _check(not (m.moe_router_topk == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax),
           "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax (a softmax over one chosen logit "
           "is 1, with no gradient for the router)")
    _check(p.tensor_model_parallel_size == 1 or p.sequence_parallel,
           "MoE layers under --tensor-model-parallel-size > 1 need --sequence-parallel (Megatron's MoE dispatches "
           "the sequence-parallel shards)")
    _check(ep >= 1 and etp >= 1, "--expert-model-parallel-size and --expert-tensor-parallel-size must be >= 1")
    _check(m.num_experts % ep == 0,
           f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {ep}; pick an EP size "
           "that divides the experts")
    per_stage = world_size // p.pipeline_model_parallel_size
    _check(per_stage % (ep * etp) == 0,
           f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} must divide the {per_stage} "
           f"ranks of a pipeline stage (TP x CP x DP): experts are spread over them, inside data parallelism")
    width = m.moe_ffn_hidden_size or m.ffn_size
    _check(width % etp == 0, f"the expert FFN size {width} is not divisible by --expert-tensor-parallel-size {etp}")
    cfg.decoder_config()  # parses --moe-layer-freq against --num-layers (its own error)
    if m.moe_grouped_gemm:
        _check(any(importlib.util.find_spec(name) is not None for name in ("transformer_engine", "grouped_gemm")),
               "--moe-grouped-gemm needs Transformer Engine or the grouped_gemm package (GPU); install one, or drop "
               "the flag (the experts then run one after another)")
    _check(not (m.moe_token_dispatcher_type == "allgather" and p.pipeline_model_parallel_size > 1
                and mechanism_class(cfg.residual.mechanism).mixes_depth),
           f"--moe-token-dispatcher-type allgather cannot take the variable-shape pipeline payloads of --residual "
           f"{cfg.residual.mechanism}; use --moe-token-dispatcher-type alltoall")
    _check(not cfg.training.deepspeed or ep == 1,
           "--deepspeed trains with ZeRO data parallelism and cannot split experts; drop --expert-model-parallel-size "
           "(ZeRO over the whole MoE model), or drop --deepspeed")


def _check_choices(cfg: "Config") -> None:
    """Fields with a fixed set of values (declared once, in each field's `choices`)."""
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            value = getattr(getattr(cfg, section), f.name)
            if choices and value not in choices:
                shown = ", ".join(str(c) for c in choices if c is not None)
                raise ConfigError(f"unknown {_field_flag(f.name)} {value!r}; choose one of {shown}")


def _check_folder(flag: str, folder: Optional[str]) -> None:
    _check(folder is None or not os.path.exists(folder) or os.path.isdir(folder),
           f"{flag} {folder} is a file, not a folder; give a folder (it is created if missing)")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------

# Flags are derived from field names with Megatron-LM's spelling (dashes): --num-layers, --dca-last-k, ...
_SECTIONS = {"model": ModelConfig, "residual": ResidualConfig, "parallel": ParallelConfig, "training": TrainingConfig,
             "data": DataConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig}


def _field_flag(name: str) -> str:
    return option_flag(name)


class _Parser(argparse.ArgumentParser):
    """argparse with a short usage line: an error prints the usage, the error and the nearest known flags (the full
    usage lists every flag, some 150 of them)."""

    def error(self, message):
        import difflib

        known = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        near = []
        if message.startswith("unrecognized arguments:"):
            for word in message.split(":", 1)[1].split():
                if word.startswith("--"):
                    near += difflib.get_close_matches(word.split("=")[0], known, n=1)
        hint = f"\ndid you mean {' or '.join(dict.fromkeys(near))}?" if near else ""
        self.exit(2, f"usage: {self.format_usage().split(': ', 1)[1].strip()}\n{self.prog}: error: {message}{hint}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m mega_depth.train",
        usage="%(prog)s [--config YAML] [--FLAG VALUE ...]   (every flag: --help)",
        description="Pretrain a depth-mixing language model on Megatron-core. Flags override --config YAML. "
                    "Paths (in flags and in the YAML alike) are relative to the working directory.",
        allow_abbrev=False,
    )
    # The deepspeed launcher appends --local_rank=N (LOCAL_RANK is in the environment as well).
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="YAML file with sections model/residual/parallel/training/data/checkpoint/logging, keys "
                             "as the flags without dashes (launch/configs/*.yaml); a run's resolved config.yaml in "
                             "its --output-dir is one")
    for section, cls in _SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            flag = _field_flag(f.name)
            dest = f"{section}.{f.name}"
            kind = _base_type(f.type)
            default = f.default if f.default is not dataclasses.MISSING else None
            flags = (flag,) + f.metadata.get("aliases", ())
            choices = [c for c in f.metadata.get("choices") or () if c is not None]  # checked in validate()
            help_text = f.metadata.get("help", "")
            if default is not None and kind is not bool:
                help_text += f" (default: {default})"
            elif kind is bool:
                help_text += f" (default: {'on' if default else 'off'})"
            help_text = help_text.replace("%", "%%")  # argparse formats help with %
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices else \
                {int: "N", float: "X", str: "STR"}.get(kind, "VALUE")
            if kind is bool:
                group.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
            elif "List" in str(f.type):
                group.add_argument(*flags, dest=dest, type=kind, nargs="+", default=None, metavar=metavar,
                                   help=help_text)
            else:
                group.add_argument(*flags, dest=dest, type=kind, default=None, metavar=metavar, help=help_text)
    return parser


def _base_type(annotation):
    text = str(annotation)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if name in text:
            return kind
    raise TypeError(f"unsupported config field type {annotation}")


def load_yaml(path: str, cfg: Config) -> Config:
    """Apply a YAML config file to cfg. Unknown sections or keys are errors that name the nearest valid key."""
    import difflib

    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; give the YAML file inside it") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start});"
                          " give a YAML file") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must map section names to settings")
    for section, values in data.items():
        if section not in _SECTIONS:
            near = difflib.get_close_matches(str(section), list(_SECTIONS), n=1)
            raise ConfigError(f"unknown section {section!r} in {path}" + (f"; did you mean {near[0]!r}?" if near else
                              f"; sections are {', '.join(_SECTIONS)}"))
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"section {section!r} in {path} must map keys to values (key: value lines indented "
                              f"under '{section}:'), got {type(values).__name__} {values!r}")
        names = {f.name: f for f in dataclasses.fields(_SECTIONS[section])}
        for key, value in (values or {}).items():
            if (section, key) == ("residual", "residual"):  # the mechanism's field before it was renamed
                key = "mechanism"
            if key not in names:
                near = difflib.get_close_matches(str(key), list(names), n=1)
                raise ConfigError(f"unknown key {section}.{key} in {path}" + (f"; did you mean {section}.{near[0]}?"
                                                                             if near else ""))
            setattr(getattr(cfg, section), key, _typed(value, names[key], f"{section}.{key} in {path}"))
    return cfg


def _typed(value, f: dataclasses.Field, where: str):
    """A YAML value for a field of the config, unchanged, or ConfigError: no silent casts (2.9 or true where an
    integer belongs would otherwise become 2 or 1)."""
    if value is None:
        if "Optional" not in str(f.type) and f.default is not None:
            raise ConfigError(f"{where} cannot be empty (null); give a value or leave the key out")
        return None
    kind = _base_type(f.type)
    if "List" in str(f.type):
        items = value if isinstance(value, list) else None
        if items is None or not all(isinstance(v, str) for v in items):
            raise ConfigError(f"{where} must be a list of strings, got {value!r}")
        return items
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string: a number all the same
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
        hint = " (quote it: '...')" if kind is str else ""
        raise ConfigError(f"{where} must be {wanted}{hint}, got {value!r} ({type(value).__name__})")
    return value


def parse_args(argv: Optional[List[str]] = None) -> Config:
    """--config YAML (if any), then command-line flags on top. Validation comes later: it needs the world size."""
    ns = build_parser().parse_args(argv)
    cfg = Config()
    if ns.config:
        load_yaml(ns.config, cfg)
    for key, value in vars(ns).items():
        if value is None or key in ("config", "local_rank"):
            continue
        section, name = key.split(".", 1)
        setattr(getattr(cfg, section), name, value)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
