"""The decoder's configuration: its shape, and the residual mechanism with that mechanism's options.

`ResidualConfig` is assembled from the registry: `residual` (the mechanism's name) plus every mechanism's
options, so a new mechanism's flags, YAML keys, checkpoint checks and exported config fields come from its own
file. `DecoderConfig` is the one description of a model that the Megatron builder, the plain decoder, the
Hugging Face export and the state-dict adapter share.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List

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


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    norm_epsilon: float = NORM_EPSILON
    rotary_base: float = 10000.0
    qk_layernorm: bool = True
    tie_word_embeddings: bool = True
    hidden_dropout: float = 0.0
    # Mixture of experts: the MLP of each layer marked 1 in moe_layer_pattern routes every token to its top-k of
    # num_experts SwiGLU experts (0 experts: dense MLPs everywhere; configs saved before MoE load as dense).
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0  # each expert's width
    moe_layer_pattern: List[int] = field(default_factory=list)  # one 0/1 per layer
    moe_shared_expert_intermediate_size: int = 0  # 0: no shared expert
    moe_router_score_function: str = "softmax"  # softmax over the top-k logits, or sigmoid scores renormalised
    moe_router_pre_softmax: bool = False  # softmax: over all experts, then the top-k (not renormalised)
    moe_router_enable_expert_bias: bool = False  # a per-expert bias on the choice (not on the weights)
    residual: Any = field(default_factory=ResidualConfig)

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
                          self.norm_epsilon)

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
