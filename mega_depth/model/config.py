"""The decoder's configuration: its shape, and the residual mechanism with that mechanism's options.

`ResidualConfig` is assembled from the registry: `residual` (the mechanism's name) plus every mechanism's
options, so a new mechanism's flags, YAML keys, checkpoint checks and exported config fields come from its own
file. `DecoderConfig` is the one description of a model that the Megatron builder, the plain decoder, the
Hugging Face export and the state-dict adapter share.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from .base import NORM_EPSILON, ModelShape, option_fields
from .registry import MECHANISMS, build

ResidualConfig = dataclasses.make_dataclass(
    "ResidualConfig",
    [("mechanism", str, field(default="standard", metadata={"help": "the depth-mixing mechanism (--residual)",
                                                           "choices": tuple(MECHANISMS)}))]
    + option_fields(list(MECHANISMS.values())),
    namespace={"__doc__": "The mechanism (--residual) and every mechanism's options (flat: --attnres-num-blocks, "
                          "...)."},
)
ResidualConfig.__module__ = __name__


def option_flag(name: str) -> str:
    """The command-line flag of a config field: --attnres-num-blocks; the mechanism itself is --residual."""
    return "--residual" if name == "mechanism" else "--" + name.replace("_", "-")


def residual_config(values: Dict[str, Any], saved: bool = False) -> "ResidualConfig":
    """A ResidualConfig from values (a named setting's, or with saved=True a checkpoint's or an exported config's,
    where an option the config does not record takes the value it meant then); unknown keys are errors."""
    values = dict(values)
    if "residual" in values:  # saved configs name the mechanism as its flag does (residual_values)
        values["mechanism"] = values.pop("residual")
    known = {f.name for f in dataclasses.fields(ResidualConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown residual option(s) {unknown}: saved by a newer mega_depth?")
    for f in dataclasses.fields(ResidualConfig):  # saved before the option's default changed: the old meaning
        if saved and f.name not in values and f.metadata.get("unrecorded") is not None:
            values[f.name] = f.metadata["unrecorded"]
    return ResidualConfig(**values)


@dataclass(frozen=True)
class Spelling:
    """How the command line and the YAML `model:` section spell one DecoderConfig field, Megatron-LM's way: the
    flag's field (name, annotation, default, help) and, where the flag says it differently, the conversions both
    ways (to_record reads the whole flag section: a default may come from other flags)."""
    help: str
    default: Any
    type: str  # the flag field's annotation, as the parser and the YAML reader read it
    name: str = ""  # "" = the record field's own name
    choices: Optional[tuple] = None
    to_record: Optional[Callable[[Any], Any]] = None  # (the flag section) -> the record's value
    from_record: Optional[Callable[[Any], Any]] = None  # (the record's value) -> the flag's value
    architecture: bool = True  # False: the record carries it, but it is a training choice (may change on resume)


def _field(help: str, cli: Any, type: str, default: Any = dataclasses.MISSING, **spelling) -> Any:
    """A DecoderConfig field with its command-line spelling (cli: the flag's default)."""
    metadata = {"flag": Spelling(help, cli, type, **spelling)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def default_ffn_size(hidden_size: int) -> int:
    """SwiGLU's width when none is given: 8/3 x hidden, rounded up to a multiple of 64."""
    return max(64, int(8 * hidden_size / 3 + 63) // 64 * 64)


def parse_moe_layer_freq(text: str, num_layers: int) -> List[int]:
    """--moe-layer-freq as Megatron-LM reads it: an int N (layer i is MoE when i % N == 0) or a list of 0/1 per
    layer written as sums of repeated lists, e.g. ([0]*1+[1]*23). Parsed, not evaluated; ValueError names the fix."""
    text = str(text).strip()
    if re.fullmatch(r"\d+", text):
        freq = int(text)
        if freq < 1:
            raise ValueError(f"--moe-layer-freq {text} must be >= 1 (every N-th layer is MoE)")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    body = text[1:-1] if text.startswith("(") and text.endswith(")") else text
    pattern: List[int] = []
    for term in body.split("+"):
        match = re.fullmatch(r"\s*\[([01](?:\s*,\s*[01])*)\]\s*(?:\*\s*(\d+))?\s*", term)
        if match is None:
            raise ValueError(f"--moe-layer-freq {text!r}: expected N or a list of 0/1 per layer such as "
                             "'([0]*1+[1]*23)'")
        pattern += [int(v) for v in match.group(1).split(",")] * int(match.group(2) or 1)
    if len(pattern) != num_layers:
        raise ValueError(f"--moe-layer-freq {text!r} lists {len(pattern)} layers but --num-layers is {num_layers}")
    return pattern


def _moe_pattern(flags) -> List[int]:
    return parse_moe_layer_freq(flags.moe_layer_freq, flags.num_layers) if flags.num_experts else []


def _or_none(value):
    return value or None  # the record's 0 ("none") is the flag's absence


@dataclass
class DecoderConfig:
    """The one record of a model's architecture. The `model:` flags are generated from it (ArchitectureFlags), and
    the checkpoint metadata, its compatibility check, --use-checkpoint-args, the Megatron builder and the HF export
    read it: a new field here is a new flag, saved, compared and restored, with no other edit."""
    num_layers: int = _field("transformer layers (each an attention and an MLP sublayer)", 4, "int")
    hidden_size: int = _field("model width d", 64, "int")
    num_attention_heads: int = _field("query heads", 4, "int")
    num_query_groups: int = _field("key/value heads for GQA (default: one per query head, MHA)", None,
                                   "Optional[int]", to_record=lambda f: f.num_query_groups or f.num_attention_heads)
    ffn_hidden_size: int = _field("SwiGLU width (default: 8/3 x hidden, rounded up to a multiple of 64)", None,
                                  "Optional[int]", to_record=lambda f: f.ffn_hidden_size or
                                  default_ffn_size(f.hidden_size))
    vocab_size: int = _field("vocabulary size; set by --tokenizer-model (with --mock-data: default 256)", None,
                             "Optional[int]")
    qk_layernorm: bool = _field("Qwen3-style RMSNorm on queries and keys", True, "bool", default=True)
    tie_word_embeddings: bool = _field(
        "separate output-layer weights instead of the embedding's", False, "bool", default=True,
        name="untie_embeddings_and_output_weights", to_record=lambda f: not f.untie_embeddings_and_output_weights,
        from_record=lambda tied: not tied)
    rotary_base: float = _field("RoPE base", 10000, "int", default=10000.0)
    norm_epsilon: float = _field("RMSNorm epsilon", NORM_EPSILON, "float", default=NORM_EPSILON)
    hidden_dropout: float = _field("dropout on each sublayer's output", 0.0, "float", default=0.0, architecture=False)
    attention_dropout: float = _field("dropout on the attention probabilities", 0.0, "float", default=0.0,
                                      architecture=False)
    # Mixture of experts (Megatron-LM's flags): the MLP of each layer marked 1 in moe_layer_pattern routes every token
    # to its top-k of num_experts SwiGLU experts (0 experts: dense MLPs everywhere; configs saved before MoE: dense).
    num_experts: int = _field("routed experts per MoE layer (default: dense MLPs)", None, "Optional[int]", default=0,
                              to_record=lambda f: f.num_experts or 0, from_record=_or_none)
    moe_router_topk: int = _field("experts each token is routed to", 2, "int", default=2)
    moe_ffn_hidden_size: int = _field(  # each expert's width
        "each expert's SwiGLU width (default: the FFN size)", None, "Optional[int]", default=0,
        to_record=lambda f: (f.moe_ffn_hidden_size or f.ffn_size) if f.num_experts else 0, from_record=_or_none)
    moe_layer_pattern: List[int] = _field(  # one 0/1 per layer
        "which layers are MoE: N (every N-th layer, from the first) or one 0/1 per layer as Megatron-LM writes it, "
        "e.g. '([0]*1+[1]*23)': a dense first layer", "1", "str", default=[], name="moe_layer_freq",
        to_record=_moe_pattern, from_record=lambda p: "(" + "+".join(f"[{v}]" for v in p) + ")" if p else "1")
    moe_shared_expert_intermediate_size: int = _field(  # 0: no shared expert
        "a shared expert of this SwiGLU width beside the routed ones, on every token", None, "Optional[int]",
        default=0, to_record=lambda f: f.moe_shared_expert_intermediate_size or 0, from_record=_or_none)
    moe_router_score_function: str = _field(
        "routing scores: softmax (over the top-k, renormalised) or sigmoid (DeepSeek-V3)", "softmax", "str",
        default="softmax", choices=("softmax", "sigmoid"))
    moe_router_pre_softmax: bool = _field(
        "softmax over all experts before the top-k (the chosen weights then sum to less than 1); needed for top-1 "
        "softmax routing", False, "bool", default=False)
    moe_router_enable_expert_bias: bool = _field(
        "DeepSeek-V3's aux-loss-free balancing: a per-expert bias on the routing choice, moved toward the "
        "under-loaded experts after each step (with --moe-router-score-function sigmoid)", False, "bool",
        default=False)
    residual: Any = field(default_factory=ResidualConfig)  # its own section (--residual and the options)

    @classmethod
    def from_flags(cls, flags, residual, vocab_size: Optional[int] = None) -> "DecoderConfig":
        """The record from the `model:` flags (ArchitectureFlags; vocab_size: the padded one, where known).
        ValueError names a flag that cannot be read (--moe-layer-freq)."""
        values = {}
        for name, spelling in flag_spellings().items():
            values[name] = spelling.to_record(flags) if spelling.to_record else getattr(flags, spelling.name or name)
        if vocab_size:
            values["vocab_size"] = vocab_size
        return cls(**values, residual=residual)

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and bool(self.moe_layer_pattern[layer])

    def active_ffn_widths(self) -> List[int]:
        """The SwiGLU width each layer runs per token: ffn_hidden_size, or on an MoE layer top-k x the expert width
        plus the shared expert's (what FLOPs and MFU count)."""
        return [self.moe_router_topk * self.moe_ffn_hidden_size + self.moe_shared_expert_intermediate_size
                if self.is_moe_layer(i) else self.ffn_hidden_size for i in range(self.num_layers)]

    def moe_values(self) -> Dict[str, Any]:
        """The MoE fields (empty for a dense model): what an exported config records beside the shape."""
        if not self.num_experts:
            return {}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name == "num_experts" or f.name.startswith("moe_")}

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.num_layers, self.hidden_size, self.num_attention_heads, self.num_query_groups,
                          self.norm_epsilon, self.qk_layernorm)

    def mechanism(self, tp: int = 1, sp: bool = False):
        return build(self.residual, self.shape, tp, sp)

    def residual_values(self) -> Dict[str, Any]:
        """The mechanism's name and its own options: what a checkpoint or an exported config records."""
        return {"residual": self.residual.mechanism, **self.mechanism().option_values()}

    def to_dict(self) -> Dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "residual"}
        out["residual"] = self.residual_values()
        return out

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> "DecoderConfig":
        values = dict(values)
        residual = values.pop("residual", {"mechanism": "standard"})
        return cls(**values, residual=residual_config(residual, saved=True))


def flag_spellings() -> Dict[str, Spelling]:
    """Every DecoderConfig field that a flag sets (all but the mechanism, which is its own section), in order."""
    return {f.name: f.metadata["flag"] for f in dataclasses.fields(DecoderConfig) if "flag" in f.metadata}


def flag_name(record_field: str) -> str:
    """The `model:` field (and, dashed, the flag) that sets a DecoderConfig field: tie_word_embeddings ->
    untie_embeddings_and_output_weights."""
    return flag_spellings()[record_field].name or record_field


def architecture_fields() -> List[str]:
    """The record's fields that make the model (not hidden_dropout, a training choice; not the mechanism)."""
    return [name for name, spelling in flag_spellings().items() if spelling.architecture]


def flag_values(record: DecoderConfig) -> Dict[str, Any]:
    """The `model:` flag values that give this record back (from_flags(flag_values(r)) == r): what an imported
    model's config is written as."""
    return {spelling.name or name: spelling.from_record(getattr(record, name)) if spelling.from_record
            else getattr(record, name) for name, spelling in flag_spellings().items()}


class _FlagReadings:
    """Readings of the architecture flags with their defaults filled in (the flags keep None: 'not given')."""

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or default_ffn_size(self.hidden_size)

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def moe_layer_pattern(self) -> List[int]:
        """1 for each MoE layer, 0 for a dense one (empty without --num-experts)."""
        return _moe_pattern(self)


def architecture_flags() -> type:
    """The `model:` section's architecture flags as a dataclass: one field per DecoderConfig field (Megatron-LM's
    name, type, default and help), with the record field each sets in its metadata. config.ModelConfig adds the
    training switches to it."""
    generated = dataclasses.make_dataclass(
        "ArchitectureFlags",
        [(s.name or name, s.type, field(default=s.default, metadata={"help": s.help, "record": name,
                                                                      **({"choices": s.choices} if s.choices else {})}))
         for name, s in flag_spellings().items()],
        bases=(_FlagReadings,),
        namespace={"__doc__": "The architecture flags (--num-layers, ...), generated from DecoderConfig's fields."},
    )
    generated.__module__ = __name__
    return generated
