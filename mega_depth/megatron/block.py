"""The transformer block that drives a residual provider, and the GPTModel that uses it.

`TransformerBlock.forward` threads one hidden state through its layers; a depth-mixing layer needs the whole
cross-layer state, so this block (a) builds the state from the embedding or unpacks it from the received pipeline
tensor, (b) runs the layers on it, with activation recomputation that checkpoints the state's tensors, and
(c) packs it for the next stage, or applies the final depth mix and the final norm on the last stage.
`GPTModel` builds `TransformerBlock` by name, so `DepthMixingGPTModel` swaps the class in for its constructor.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import gpt_model as gpt_model_module
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import make_viewless_tensor

from mega_depth import mixing
from mega_depth.config import Config
from mega_depth.megatron import providers as prov
from mega_depth.megatron.layers import mark_replicated


class DepthMixingBlock(TransformerBlock):
    def setup_provider(self, cfg: Config, provider: prov.Provider, geometry: prov.StageGeometry) -> None:
        self.cfg = cfg
        self.provider = provider
        self.geometry = geometry
        self.first_layer = self.layers[0].layer_number - 1  # 0-based global index
        self.stage = geometry.stage_of_first_layer(self.first_layer)
        d, dtype = self.config.hidden_size, self.config.params_dtype
        if self.final_layernorm is not None:  # the stage that ends the decoder also does the final depth mix
            kind = cfg.residual.residual
            if kind == "attnres":
                self.final_mixer = mixing.AttnResMixer(d, self.config.layernorm_epsilon, dtype)
            elif kind == "dca":
                sources = mixing.dca_num_sources(cfg.model.num_layers + 1, cfg.residual.dca_last_k)
                self.final_grn = mixing.GRN(d, sources, cfg.residual.dca_grn, count=1, dtype=dtype)
            mark_replicated(self, self.config)

    # --- state in / out ---------------------------------------------------------------------------------------
    def _microbatch(self) -> int:
        return getattr(self.layers[0], "current_microbatch", 0) or 0

    def _state_in(self, hidden_states):
        p, geo = self.provider, self.geometry
        if self.pre_process:
            return p.initial_state(hidden_states)
        sent, cached = prov.hop_layout(p, geo, self.stage, self.cfg.residual.vp_cache)
        entries = p.unpack(self.input_tensor, sent)
        if cached:
            entries.update(prov.take_stash(self.stage, self._microbatch(), [e.name for e in cached]))
        return p.state_from(entries, self.first_layer)

    def _state_out(self, state):
        p, geo = self.provider, self.geometry
        next_stage = self.stage + 1
        entries = p.entries(state)
        sent, _ = prov.hop_layout(p, geo, next_stage, self.cfg.residual.vp_cache)
        carrier_name = sent[0].name
        if self.cfg.residual.vp_cache and geo.vpp > 1 and self.stage + geo.pp < geo.num_stages:
            # This rank runs stage `self.stage + pp` of the same micro-batch next: keep what it will not receive.
            _, keep = prov.hop_layout(p, geo, self.stage + geo.pp, True)
            if keep:
                entries[carrier_name] = prov.stash_for_next_chunk(
                    entries, [e.name for e in keep], self.stage + geo.pp, self._microbatch(), entries[carrier_name]
                )
        packed = p.pack(entries, sent)
        prov.HOP_COUNTER.record(next_stage, packed)
        return packed

    # --- layers ---------------------------------------------------------------------------------------------
    def _run_layers(self, state, layer_kwargs):
        recompute = self.config.recompute_granularity == "full" and self.training
        if not recompute:
            for layer in self.layers:
                state = layer(state, **layer_kwargs)
            return state
        p = self.provider
        n = self.config.recompute_num_layers
        uniform = self.config.recompute_method == "uniform"
        start = 0
        while start < len(self.layers):
            end = min(start + n, len(self.layers)) if uniform else start + 1
            checkpoint = uniform or start < n  # "block": checkpoint the first n layers only
            in_layout = [e.name for e in p.layout(self.first_layer + start)]
            out_layout = [e.name for e in p.layout(self.first_layer + end)]

            def run(*tensors, _s=start, _e=end, _in=in_layout, _out=out_layout):
                st = p.state_from(dict(zip(_in, tensors)), self.first_layer + _s)
                for layer in self.layers[_s:_e]:
                    st = layer(st, **layer_kwargs)
                ent = p.entries(st)
                return tuple(ent[name] for name in _out)

            ent = p.entries(state)
            args = [ent[name] for name in in_layout]
            outs = tensor_parallel.checkpoint(run, False, *args) if checkpoint else run(*args)
            if isinstance(outs, torch.Tensor):
                outs = (outs,)
            state = p.state_from(dict(zip(out_layout, outs)), self.first_layer + end)
            start = end
        return state

    def forward(self, hidden_states, attention_mask, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                inference_context=None, packed_seq_params=None, sequence_len_offset=None, padding_mask=None, *,
                inference_params=None, dynamic_inference_decode_only=None):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("depth-mixing models decode through the Hugging Face export (tools/"
                                      "convert_to_hf.py), not Megatron's inference engine")
        if hasattr(hidden_states, "unwrap"):
            hidden_states = hidden_states.unwrap()
        layer_kwargs = dict(attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else \
            contextlib.nullcontext()
        with rng:
            state = self._run_layers(self._state_in(hidden_states), layer_kwargs)
            if self.final_layernorm is None:
                out = self._state_out(state)
            else:
                out = self.final_layernorm(self.provider.final_hidden(state, self))
        return make_viewless_tensor(inp=out, requires_grad=True, keep_graph=True)


    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # DCA's GRNs grow with depth (one column per source), so layers differ in shape: checkpoint them per layer.
        if self.cfg.residual.residual == "dca":
            metadata = dict(metadata or {}, non_homogeneous_layers=True)
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)


@contextlib.contextmanager
def _decoder_class(block_class):
    """GPTModel.__init__ names TransformerBlock directly (megatron-core 0.16.1); swap it for one construction."""
    original = gpt_model_module.TransformerBlock
    gpt_model_module.TransformerBlock = block_class
    try:
        yield
    finally:
        gpt_model_module.TransformerBlock = original


class DepthMixingGPTModel(GPTModel):
    """Megatron's GPTModel with a DepthMixingBlock decoder driven by the mechanism's provider."""

    def __init__(self, *args, mega_depth_config: Config, provider: prov.Provider, geometry: prov.StageGeometry,
                 **kwargs):
        with _decoder_class(DepthMixingBlock):
            super().__init__(*args, **kwargs)
        self.decoder.setup_provider(mega_depth_config, provider, geometry)
