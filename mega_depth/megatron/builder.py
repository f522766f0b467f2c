"""Config -> Megatron-core TransformerConfig, layer ModuleSpec and GPTModel chunks (one per virtual stage)."""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from mega_depth.config import Config
from mega_depth import kernels
from mega_depth.init import initial_value, padded_vocab_size
from mega_depth.megatron.attention import SDPAttention
from mega_depth.megatron.block import DepthMixingGPTModel
from mega_depth.megatron.compile import compile_layers
from mega_depth.megatron.layer import DepthMixingLayer, DepthMixingSelfAttention
from mega_depth.megatron import swiglu
from mega_depth.megatron.norm import RMSNorm
from mega_depth.megatron.pipeline import DepthPipeline, StageGeometry
from mega_depth.model.config import DecoderConfig
from mega_depth.model.registry import build as build_mechanism, mechanism_class
from mega_depth.model.state_dict_adapter import is_expert_param, renumber_experts


def transformer_config(cfg: Config) -> TransformerConfig:
    """Megatron's TransformerConfig: the decoder's shape from DecoderConfig (the one description of the model),
    the layout and the training switches from the run's config."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    dc = cfg.decoder_config()
    dtype = torch.bfloat16 if t.bf16 else torch.float32
    needs_variable_shapes = mechanism_class(cfg.residual.mechanism).mixes_depth and p.pipeline_model_parallel_size > 1
    return TransformerConfig(
        num_layers=dc.num_layers,
        hidden_size=dc.hidden_size,
        num_attention_heads=dc.num_attention_heads,
        num_query_groups=dc.num_query_groups,
        ffn_hidden_size=dc.ffn_hidden_size,
        kv_channels=dc.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=dc.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=dc.qk_layernorm,
        hidden_dropout=dc.hidden_dropout,
        attention_dropout=dc.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_size,
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.bf16,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=swiglu.enabled(),  # Liger's fused SwiGLU on a GPU (megatron/swiglu.py)
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        fused_single_qkv_rope=m.fused_single_qkv_rope,
        # Depth-mixing payloads change width from hop to hop: exchange shapes first (docs/mechanisms.md §11).
        variable_seq_lengths=needs_variable_shapes,
        recompute_granularity=p.recompute_granularity,
        recompute_method=p.recompute_method if p.recompute_granularity == "full" else None,
        recompute_num_layers=p.recompute_num_layers if p.recompute_granularity == "full" else None,
        deterministic_mode=False,
        deallocate_pipeline_outputs=False,
        **moe_settings(cfg, dc),
    )


# DecoderConfig's MoE fields that Megatron's TransformerConfig names or spells otherwise (0 is "none" in the record)
_MEGATRON_MOE = {"num_experts": ("num_moe_experts", int), "moe_layer_pattern": ("moe_layer_freq", list),
                 "moe_shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size", lambda v: v or None)}


def moe_settings(cfg: Config, dc: DecoderConfig) -> dict:
    """TransformerConfig's mixture-of-experts fields (none for a dense model): the record's MoE fields, each under
    Megatron's name, then the training switches and the expert layout. Dropless (no capacity factor), the router in
    fp32."""
    m, p = cfg.model, cfg.parallel
    if not dc.num_experts:
        return {"moe_token_dispatcher_type": "alltoall"}
    record = {}
    for name, value in dc.moe_values().items():
        megatron_name, convert = _MEGATRON_MOE.get(name, (name, None))
        record[megatron_name] = convert(value) if convert else value
    return dict(
        record,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_grouped_gemm=m.moe_grouped_gemm,
        moe_router_dtype="fp32",
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size or p.tensor_model_parallel_size,
    )


def mechanism_of(cfg: Config, tp: int = 1):
    """The mechanism instance for this rank (TP and SP only set its pipeline-payload widths), with the fast path
    of --mixing-impl."""
    mechanism = build_mechanism(cfg.residual, cfg.decoder_config().shape, tp, cfg.parallel.sequence_parallel)
    mechanism.kernels = kernels.select(cfg.model.mixing_impl or kernels.default_impl())
    mechanism.recompute_mixing = cfg.model.mixing_recompute
    return mechanism


def transformer_impl(cfg: Config) -> str:
    """--transformer-impl, resolved: Transformer Engine's spec where it is importable on a GPU and the mechanism can
    run on its fused norm+QKV projection (not DCA), else the local one."""
    if cfg.model.transformer_impl is not None:
        return cfg.model.transformer_impl
    if torch.cuda.is_available() and mechanism_class(cfg.residual.mechanism).runs_on_fused_norm_qkv:
        try:
            import transformer_engine  # noqa: F401

            return "transformer_engine"
        except ImportError:
            pass
    return "local"


def layer_spec(cfg: Config, mechanism, moe: bool = False) -> ModuleSpec:
    """Megatron's GPT layer (Llama/Qwen3 choices): the local spec with SP-capable RMSNorms and torch SDPA core
    attention (or Megatron's unfused one, --attention-backend unfused), or Transformer Engine's spec; with `moe`,
    Megatron's MoE layer as the MLP; for a depth-mixing mechanism the same submodules under DepthMixingLayer /
    DepthMixingSelfAttention."""
    experts = dict(num_experts=cfg.model.num_experts, moe_grouped_gemm=cfg.model.moe_grouped_gemm) if moe else {}
    if transformer_impl(cfg) == "transformer_engine":  # validated: Transformer Engine is installed
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = copy.deepcopy(get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.model.qk_layernorm,
                                                                        **experts))
    else:
        spec = copy.deepcopy(get_gpt_layer_local_spec(qk_layernorm=cfg.model.qk_layernorm, normalization="RMSNorm",
                                                      **experts))
        subs = spec.submodules
        subs.input_layernorm = RMSNorm
        subs.pre_mlp_layernorm = RMSNorm
        attn = subs.self_attention.submodules
        attn.q_layernorm = RMSNorm if cfg.model.qk_layernorm else IdentityOp
        attn.k_layernorm = RMSNorm if cfg.model.qk_layernorm else IdentityOp
        if cfg.model.attention_backend == "sdpa":
            attn.core_attention = SDPAttention
    if mechanism.mixes_depth:
        subs = spec.submodules
        spec.module = DepthMixingLayer
        spec.params = {"mechanism": mechanism}
        subs.self_attention.module = DepthMixingSelfAttention
        subs.self_attention.params = dict(subs.self_attention.params,
                                          values_per_query_head=mechanism.value_heads_per_query_head)
    return spec


def build_model_chunks(cfg: Config) -> List[GPTModel]:
    """One GPTModel per virtual pipeline stage held by this rank (parallel_state must be initialised)."""
    dc, tconfig = cfg.decoder_config(), transformer_config(cfg)
    if tconfig.bias_activation_fusion:
        swiglu.apply()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = cfg.virtual_pipeline_size or 1
    mechanism = mechanism_of(cfg, parallel_state.get_tensor_model_parallel_world_size())
    specs = {False: layer_spec(cfg, mechanism), True: layer_spec(cfg, mechanism, moe=True) if dc.num_experts else None}
    geometry = StageGeometry(dc.num_layers, pp, vpp)
    pipeline = DepthPipeline(mechanism, geometry, cfg.parallel.vp_cache)  # one per rank, shared by its chunks
    chunks = []
    for vp_stage in range(vpp):
        vp_arg = vp_stage if vpp > 1 else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_arg)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_arg)
        first = geometry.start(vp_stage * pp + pp_rank)
        block_spec = TransformerBlockSubmodules(
            layer_specs=[specs[dc.is_moe_layer(first + i)]
                         for i in range(get_num_layers_to_build(tconfig, vp_stage=vp_arg, pp_rank=pp_rank))],
            layer_norm=RMSNorm,
        )
        kwargs = dict(
            config=tconfig,
            transformer_layer_spec=block_spec,
            vocab_size=padded_vocab_size(cfg.model.vocab_size),
            max_sequence_length=cfg.model.seq_length,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=dc.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=dc.rotary_base,
            vp_stage=vp_arg,
        )
        if mechanism.mixes_depth:
            model = DepthMixingGPTModel(**kwargs, mechanism=mechanism, pipeline=pipeline)
        else:
            model = GPTModel(**kwargs)
        model.model_type = ModelType.encoder_or_decoder
        init_layout_independent(model, cfg, mechanism, geometry, vp_stage, pp_rank)
        chunks.append(model)
    if cfg.model.compile_layers:
        count = compile_layers(chunks, mechanism, cfg.model.num_layers)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"--compile-layers: the {count} layers of rank 0 run compiled with torch.compile, each whole (norms, "
                  "attention, MLP and the depth mixing; the first steps pay the compilation)", flush=True)
    return chunks


# ----------------------------------------------------------------------------------------------------------------
# Initialisation that does not depend on the parallel layout
# ----------------------------------------------------------------------------------------------------------------


def global_param_name(local_name: str, first_layer: int, first_expert: int = 0) -> str:
    """decoder.layers.<local>.x -> decoder.layers.<global>.x, and a local expert's index -> its global one (the name
    is the same in every layout: a single process's)."""
    parts = local_name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + first_layer)
    name = ".".join(parts)
    return renumber_experts(name, first_expert) if first_expert else name


def first_local_expert(cfg: Config) -> int:
    """The global index of this rank's first expert (expert parallelism splits them in contiguous runs)."""
    if not cfg.model.num_experts:
        return 0
    ep = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (cfg.model.num_experts // ep)


def init_layout_independent(model: GPTModel, cfg: Config, mechanism, geometry: StageGeometry, vp_stage: int,
                            pp_rank: int):
    """Re-initialise every random matrix from a generator keyed by (seed, global parameter name), drawing the
    FULL tensor and keeping this rank's TP shard. Any TP x PP x VPP layout then starts from the same weights as
    the single-process model, which is what makes losses comparable across layouts (and reproducible)."""
    m = cfg.model
    _assign_full_tensors(model, cfg, geometry, vp_stage, pp_rank, lambda name, shape: initial_value(
        cfg.training.seed, name, shape, m.init_method_std, m.num_layers, mechanism))


def load_full_state(chunks: List[GPTModel], full: Dict[str, torch.Tensor], cfg: Config) -> None:
    """Weights-only load: every parameter of this rank's chunks takes its shard of the full (TP=1, PP=1) Megatron
    state dict `full` (mega_depth/checkpoint/weights.py reads one from any checkpoint format)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    geometry = StageGeometry(cfg.model.num_layers, parallel_state.get_pipeline_model_parallel_world_size(),
                             cfg.virtual_pipeline_size or 1)

    def value_of(name, shape):
        if name not in full:
            raise KeyError(f"the loaded weights have no {name}")
        if tuple(full[name].shape) != tuple(shape):
            raise ValueError(f"{name}: the loaded weights have shape {tuple(full[name].shape)}, the model "
                             f"{tuple(shape)}")
        return full[name]

    for vp_stage, chunk in enumerate(chunks):
        _assign_full_tensors(chunk, cfg, geometry, vp_stage, pp_rank, value_of)


def _assign_full_tensors(model: GPTModel, cfg: Config, geometry: StageGeometry, vp_stage: int, pp_rank: int,
                         value_of: Callable[[str, List[int]], Optional[torch.Tensor]]) -> None:
    """param <- this rank's TP shard of value_of(global name, full shape), for every parameter it gives."""
    first_layer = geometry.start(vp_stage * geometry.pp + pp_rank)
    first_expert = first_local_expert(cfg)
    with torch.no_grad():
        for local_name, param in model.named_parameters():
            name = global_param_name(local_name, first_layer, first_expert)
            if is_expert_param(name):
                tp_rank = parallel_state.get_expert_tensor_parallel_rank()
                tp = parallel_state.get_expert_tensor_parallel_world_size()
            else:
                tp_rank = parallel_state.get_tensor_model_parallel_rank()
                tp = parallel_state.get_tensor_model_parallel_world_size()
            if name == "output_layer.weight" and not cfg.model.untie_embeddings_and_output_weights:
                name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
            full_shape = list(param.shape)
            dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
            if dim >= 0:
                full_shape[dim] *= tp
            full = value_of(name, full_shape)
            if full is None:
                continue
            if dim >= 0:
                stride = getattr(param, "partition_stride", 1)
                pieces = full.chunk(tp * stride, dim=dim)[tp_rank::tp]
                full = torch.cat(pieces, dim=dim)
            param.copy_(full.to(param.dtype))
