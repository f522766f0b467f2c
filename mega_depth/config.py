"""Typed configuration: model, residual mechanism, parallel layout, training. Validated once, at start-up.

Flag names follow Megatron-LM where Megatron-LM has the flag, so that users keep their muscle memory.
Every invalid combination fails in `validate()` with a message that names the fix; nothing is left to fail
deep inside a step.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

from mega_depth.model.config import DecoderConfig, ResidualConfig, option_flag
from mega_depth.model.registry import MECHANISMS, mechanism_class

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
ATTENTION_BACKENDS = ("sdpa", "unfused")
MIXING_IMPLS = ("eager", "compiled", "triton")


class ConfigError(ValueError):
    """A configuration that cannot work. The message says what to change."""


@dataclass
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None = MHA; fewer = GQA
    ffn_hidden_size: Optional[int] = None  # None = Llama's 8/3 * hidden rounded to a multiple of 64
    seq_length: int = 64
    vocab_size: Optional[int] = None  # from --tokenizer-model; needed with --mock-data (default 256 there)
    qk_layernorm: bool = True  # Qwen3-style q/k RMSNorm
    untie_embeddings_and_output_weights: bool = False
    rotary_base: int = 10000
    norm_epsilon: float = 1e-6
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # local: Megatron-core's local spec (torch ops); transformer_engine: its TE spec. None: TE where it is importable
    # on a GPU, else local (said once at start-up)
    transformer_impl: Optional[str] = None
    attention_backend: str = "sdpa"  # local spec's core attention: torch SDPA (fused kernels) | unfused (Megatron's)
    fused_single_qkv_rope: bool = False
    # eager (mixing.py, the reference) | compiled (torch.compile'd twins) | triton (fused Functions, kernels on a GPU);
    # None: triton on a GPU where triton is importable, else eager
    mixing_impl: Optional[str] = None
    # on the fast paths (compiled, triton): recompute in backward what the mixing makes (DCA's q/k/v inputs, Block
    # AttnRes's phase-2 merge, Depth-Attention's normalised keys) instead of keeping it; trades memory-bound
    # recompute for activation memory near the baseline's
    mixing_recompute: bool = True
    # torch.compile every layer's norms, attention and MLP (megatron/compile.py): fuses their elementwise chains,
    # which dominate the launch-bound small sizes on a GPU; eager stays the reference
    compile_layers: bool = False

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return max(64, int(8 * self.hidden_size / 3 + 63) // 64 * 64)

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute_granularity: Optional[str] = None  # None | full | selective
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    vp_cache: bool = True  # with virtual stages, send only the depth entries the receiver does not hold yet


@dataclass
class TrainingConfig:
    micro_batch_size: int = 2
    global_batch_size: Optional[int] = None  # None = micro_batch_size * data-parallel size
    train_iters: int = 10
    exit_interval: Optional[int] = None  # stop (after saving) once the step count is a multiple of this
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"  # constant | linear | cosine | inverse-square-root | WSD
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None  # None = train_iters
    lr_wsd_decay_iters: Optional[int] = None  # WSD: length of the final decay (None = 10% of lr_decay_iters)
    lr_wsd_decay_style: str = "linear"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    bf16: bool = False
    on_nan: str = "stop"  # stop | skip: what a NaN/inf loss does
    deepspeed: bool = False
    deepspeed_config: Optional[str] = None


@dataclass
class DataConfig:
    mock_data: bool = False
    data_path: Optional[List[str]] = None  # Megatron-LM style: PREFIX [PREFIX ...] or W1 PREFIX1 W2 PREFIX2 ...
    split: str = "969,30,1"
    tokenizer_model: Optional[str] = None  # sentencepiece model; sets the vocabulary
    eval_interval: Optional[int] = None
    eval_iters: int = 10
    data_cache_path: Optional[str] = None


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    keep_last: int = 3  # this run's checkpoints kept in --save (its older ones are deleted after a save)
    # allow a run started from scratch to save beside another run's checkpoints (a step it saves replaces the same
    # step of the other run; pruning still removes only this run's own checkpoints)
    overwrite_save: bool = False


@dataclass
class LoggingConfig:
    output_dir: str = "runs/default"  # metrics.jsonl, TensorBoard events and heatmaps go here
    log_interval: int = 1
    tensorboard: bool = True
    heatmap_interval: Optional[int] = None  # log depth-mixing weight heatmaps every N steps (None = at the end)


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
        return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)

    def num_microbatches(self, world_size: int) -> int:
        t = self.training
        dp = self.data_parallel_size(world_size)
        gbs = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * dp
        return gbs // (t.micro_batch_size * dp)

    def validate(self, world_size: int = 1) -> "Config":
        """Refuse every combination that cannot work, naming the fix. Returns self."""
        m, r, p, t = self.model, self.residual, self.parallel, self.training
        _check(r.mechanism in MECHANISMS, f"unknown --residual {r.mechanism!r}; choose one of {', '.join(MECHANISMS)}")
        _check_choices(self)
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
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        _check(tp >= 1 and pp >= 1, "parallel sizes must be >= 1")
        _check(
            world_size % (tp * pp) == 0,
            f"world size {world_size} is not divisible by TP x PP = {tp} x {pp}; launch a multiple of {tp * pp} "
            "processes (torchrun --nproc-per-node)",
        )
        _check(m.num_attention_heads % tp == 0,
               f"--num-attention-heads {m.num_attention_heads} is not divisible by "
               f"--tensor-model-parallel-size {tp}")
        _check(m.query_groups % tp == 0,
               f"--num-query-groups {m.query_groups} is not divisible by --tensor-model-parallel-size {tp}; "
               "use a TP size that divides the key-value heads")
        _check(m.ffn_size % tp == 0, f"the FFN size {m.ffn_size} is not divisible by TP={tp}")
        if m.vocab_size is None and self.data.mock_data:
            m.vocab_size = 256
        _check(m.vocab_size is not None, "the vocabulary size comes from --tokenizer-model (or --vocab-size with "
                                         "--mock-data)")
        _check(m.vocab_size >= 2, "--vocab-size must be at least 2")
        if p.sequence_parallel:
            _check(tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
            _check(m.seq_length % tp == 0,
                   f"--seq-length {m.seq_length} is not divisible by TP={tp}, which --sequence-parallel needs")
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
        decay = t.lr_decay_iters or t.train_iters
        _check(t.lr_warmup_iters < decay,
               f"--lr-warmup-iters {t.lr_warmup_iters} must be below the decay length ({decay}: --lr-decay-iters, "
               "else --train-iters)")
        _check(t.exit_interval is None or t.exit_interval >= 1, "--exit-interval must be >= 1")
        d, c, log = self.data, self.checkpoint, self.logging
        _check(d.mock_data != bool(d.data_path),
               "give exactly one data source: --data-path PREFIX... (see tools/preprocess_data.py) or --mock-data")
        if d.data_path:
            _check(d.tokenizer_model is not None, "--data-path needs --tokenizer-model (the tokenizer that made it)")
        if d.tokenizer_model is not None:
            import os

            _check(os.path.isfile(d.tokenizer_model),
                   f"--tokenizer-model {d.tokenizer_model} does not exist; train one with tools/train_tokenizer.py")
        _check(d.eval_interval is None or d.eval_interval >= 1, "--eval-interval must be >= 1")
        _check(d.eval_iters >= 1, "--eval-iters must be >= 1")
        _check(c.save_interval is None or c.save is not None, "--save-interval needs --save DIR")
        _check(c.save_interval is None or c.save_interval >= 1, "--save-interval must be >= 1")
        _check(c.keep_last >= 1, "--keep-last must be >= 1")
        _check(log.log_interval >= 1, "--log-interval must be >= 1")
        _check(log.heatmap_interval is None or log.heatmap_interval >= 1, "--heatmap-interval must be >= 1")
        if t.deepspeed:
            _check(t.deepspeed_config is not None, "--deepspeed needs --deepspeed-config ds.json")
            _check(p.pipeline_model_parallel_size == 1,
                   "the DeepSpeed engine shards data-parallel state (ZeRO) and cannot drive Megatron's pipeline "
                   "schedules; use --pipeline-model-parallel-size 1 with --deepspeed, or drop --deepspeed")
            _check(not p.use_distributed_optimizer,
                   "--use-distributed-optimizer is Megatron's ZeRO-1; with --deepspeed use the ZeRO stage in the "
                   "DeepSpeed config instead")
            _check(p.tensor_model_parallel_size == 1,
                   "--deepspeed trains with data parallelism (ZeRO); use the Megatron path (no --deepspeed) for "
                   "tensor or pipeline parallelism")
        dp = self.data_parallel_size(world_size)
        if t.global_batch_size is not None:
            _check(
                t.global_batch_size % (t.micro_batch_size * dp) == 0,
                f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size x data-parallel "
                f"size ({t.micro_batch_size} x {dp})",
            )
        vpp = self.virtual_pipeline_size
        if vpp is not None:
            nmb = self.num_microbatches(world_size)
            _check(nmb % pp == 0,
                   f"interleaved pipelines need the number of micro-batches ({nmb}) to be a multiple of "
                   f"--pipeline-model-parallel-size {pp}; raise --global-batch-size")
            _check(r.mechanism == "standard" or nmb >= 2 * pp,
                   f"interleaved pipelines with --residual {r.mechanism} need at least 2 x "
                   f"--pipeline-model-parallel-size micro-batches per step (got {nmb}): with every micro-batch in "
                   "warm-up the variable-shape p2p exchange deadlocks on this version; raise --global-batch-size")
        mechanism_class(r.mechanism).validate(self, _check)
        return self

    def decoder_config(self, vocab_size: Optional[int] = None) -> DecoderConfig:
        """The model as the plain decoder, the HF export and the state-dict adapter see it (vocab_size: padded)."""
        m = self.model
        return DecoderConfig(
            vocab_size=vocab_size or m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
            num_attention_heads=m.num_attention_heads, num_query_groups=m.query_groups, ffn_hidden_size=m.ffn_size,
            norm_epsilon=m.norm_epsilon, rotary_base=m.rotary_base, qk_layernorm=m.qk_layernorm,
            tie_word_embeddings=not m.untie_embeddings_and_output_weights, hidden_dropout=m.hidden_dropout,
            residual=self.residual)


def _check_choices(cfg: "Config") -> None:
    """Fields with a fixed set of values (declared once, in `choices` metadata or the tuples above)."""
    fixed = {("model", "attention_backend"): ATTENTION_BACKENDS, ("model", "mixing_impl"): (None,) + MIXING_IMPLS,
             ("model", "transformer_impl"): (None,) + TRANSFORMER_IMPLS,
             ("training", "lr_decay_style"): LR_DECAY_STYLES, ("training", "on_nan"): ("stop", "skip"),
             ("training", "lr_wsd_decay_style"): ("linear", "cosine", "exponential", "minus_sqrt"),
             ("parallel", "recompute_granularity"): (None, "full", "selective"),
             ("parallel", "recompute_method"): ("uniform", "block")}
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices") or fixed.get((section, f.name))
            value = getattr(getattr(cfg, section), f.name)
            if choices and value not in choices:
                shown = ", ".join(str(c) for c in choices if c is not None)
                raise ConfigError(f"unknown {_field_flag(f.name)} {value!r}; choose one of {shown}")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mega_depth.train",
        description="Pretrain a depth-mixing language model on Megatron-core. Flags override --config YAML.",
        allow_abbrev=False,
    )
    # The deepspeed launcher appends --local_rank=N (LOCAL_RANK is in the environment as well).
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="YAML file with sections model/residual/parallel/training/data/checkpoint/logging")
    for section, cls in _SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            flag = _field_flag(f.name)
            dest = f"{section}.{f.name}"
            kind = _base_type(f.type)
            default = f.default if f.default is not dataclasses.MISSING else None
            choices = f.metadata.get("choices")  # checked in validate(), with the config-error message
            help_text = f.metadata.get("help", "") + (f"; one of {', '.join(map(str, choices))}" if choices else "") \
                + (f" (default: {default})" if default is not None else "")
            if kind is bool:
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text or None)
            elif "List" in str(f.type):
                group.add_argument(flag, dest=dest, type=kind, nargs="+", default=None, metavar=f.name.upper(),
                                   help=help_text or None)
            else:
                group.add_argument(flag, dest=dest, type=kind, default=None, metavar=f.name.upper(),
                                   help=help_text or None)
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
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
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
