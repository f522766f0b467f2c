"""Config -> Megatron-core TransformerConfig, layer ModuleSpec and GPTModel chunks (one per virtual stage)."""

from __future__ import annotations

import copy
from typing import List

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
from mega_depth.init import is_random_init, keyed_normal, padded_vocab_size  # noqa: F401 (re-exported)
from mega_depth.megatron.block import DepthMixingGPTModel
from mega_depth.megatron.layers import DepthMixingLayer, DepthMixingSelfAttention
from mega_depth.megatron.norm import RMSNorm
from mega_depth.megatron.providers import StageGeometry, make_provider


def transformer_config(cfg: Config) -> TransformerConfig:
    m, p, t = cfg.model, cfg.parallel, cfg.training
    dtype = torch.bfloat16 if t.bf16 else torch.float32
    needs_variable_shapes = cfg.residual.residual != "standard" and p.pipeline_model_parallel_size > 1
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        ffn_hidden_size=m.ffn_size,
        kv_channels=m.hidden_size // m.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=m.qk_layernorm,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_size,
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.bf16,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        fused_single_qkv_rope=m.fused_single_qkv_rope,
        # Depth-mixing payloads change width from hop to hop: exchange shapes first (SPEC.md section 4).
        variable_seq_lengths=needs_variable_shapes,
        moe_token_dispatcher_type="alltoall",
        recompute_granularity=p.recompute_granularity,
        recompute_method=p.recompute_method if p.recompute_granularity == "full" else None,
        recompute_num_layers=p.recompute_num_layers if p.recompute_granularity == "full" else None,
        deterministic_mode=False,
        deallocate_pipeline_outputs=False,
    )


def layer_spec(cfg: Config) -> ModuleSpec:
    """Megatron's local GPT layer (Llama/Qwen3 choices) with SP-capable RMSNorms; for a depth-mixing mechanism
    the same submodules under DepthMixingLayer / DepthMixingSelfAttention."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(qk_layernorm=cfg.model.qk_layernorm, normalization="RMSNorm"))
    subs = spec.submodules
    subs.input_layernorm = RMSNorm
    subs.pre_mlp_layernorm = RMSNorm
    attn = subs.self_attention.submodules
    attn.q_layernorm = RMSNorm if cfg.model.qk_layernorm else IdentityOp
    attn.k_layernorm = RMSNorm if cfg.model.qk_layernorm else IdentityOp
    if cfg.model.attention_backend == "te":  # validated: TransformerEngine is installed
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        attn.core_attention = TEDotProductAttention
    if cfg.residual.residual != "standard":
        spec.module = DepthMixingLayer
        spec.params = {"residual": cfg.residual}
        subs.self_attention.module = DepthMixingSelfAttention
        subs.self_attention.params = dict(
            subs.self_attention.params,
            depth_attn_query_heads=cfg.residual.residual == "depth-attention" and cfg.residual.depth_attn_gqa == "query",
        )
    return spec


def build_model_chunks(cfg: Config) -> List[GPTModel]:
    """One GPTModel per virtual pipeline stage held by this rank (parallel_state must be initialised)."""
    tconfig = transformer_config(cfg)
    spec = layer_spec(cfg)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = cfg.virtual_pipeline_size or 1
    tp = parallel_state.get_tensor_model_parallel_world_size()
    geometry = StageGeometry(cfg.model.num_layers, pp, vpp)
    chunks = []
    for vp_stage in range(vpp):
        vp_arg = vp_stage if vpp > 1 else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_arg)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_arg)
        block_spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(tconfig, vp_stage=vp_arg, pp_rank=pp_rank),
            layer_norm=RMSNorm,
        )
        kwargs = dict(
            config=tconfig,
            transformer_layer_spec=block_spec,
            vocab_size=padded_vocab_size(cfg.model.vocab_size),
            max_sequence_length=cfg.model.seq_length,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
            position_embedding_type="rope",
            rotary_base=cfg.model.rotary_base,
            vp_stage=vp_arg,
        )
        if cfg.residual.residual == "standard":
            model = GPTModel(**kwargs)
        else:
            model = DepthMixingGPTModel(**kwargs, mega_depth_config=cfg, provider=make_provider(cfg, tp),
                                        geometry=geometry)
        model.model_type = ModelType.encoder_or_decoder
        init_layout_independent(model, cfg, geometry, vp_stage, pp_rank)
        chunks.append(model)
    return chunks


# ----------------------------------------------------------------------------------------------------------------
# Initialisation that does not depend on the parallel layout
# ----------------------------------------------------------------------------------------------------------------


def global_param_name(local_name: str, first_layer: int) -> str:
    """decoder.layers.<local>.x -> decoder.layers.<global>.x (the name is the same in every layout)."""
    parts = local_name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + first_layer)
    return ".".join(parts)


def init_layout_independent(model: GPTModel, cfg: Config, geometry: StageGeometry, vp_stage: int, pp_rank: int):
    """Re-initialise every random matrix from a generator keyed by (seed, global parameter name), drawing the
    FULL tensor and keeping this rank's TP shard. Any TP x PP x VPP layout then starts from the same weights as
    the single-process model, which is what makes losses comparable across layouts (and reproducible)."""
    first_layer = geometry.start(vp_stage * geometry.pp + pp_rank)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for local_name, param in model.named_parameters():
            if not is_random_init(local_name, param):
                continue
            name = global_param_name(local_name, first_layer)
            if name == "output_layer.weight" and not cfg.model.untie_embeddings_and_output_weights:
                name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
            full_shape = list(param.shape)
            dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
            if dim >= 0:
                full_shape[dim] *= tp
            full = keyed_normal(cfg.training.seed, name, full_shape, cfg.model.init_method_std, cfg.model.num_layers)
            if dim >= 0:
                stride = getattr(param, "partition_stride", 1)
                pieces = full.chunk(tp * stride, dim=dim)[tp_rank::tp]
                full = torch.cat(pieces, dim=dim)
            param.copy_(full.to(param.dtype))
