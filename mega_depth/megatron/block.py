"""The transformer block that drives a mechanism, and the GPTModel that uses it.

`TransformerBlock.forward` threads one hidden state through its layers; a depth-mixing mechanism needs its whole
cross-layer state, so this block (a) builds the state from the embedding or unpacks it from the received
pipeline tensor, (b) lets the mechanism run its layers on it, with activation recomputation that checkpoints
the state's tensors, and (c) packs it for the next stage, or applies the final depth mix and the final norm on
the last stage. `GPTModel` builds `TransformerBlock` by name, so `DepthMixingGPTModel` swaps the class in for
its constructor.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import gpt_model as gpt_model_module
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import make_viewless_tensor

from mega_depth.megatron.layer import mark_replicated
from mega_depth.megatron.pipeline import DepthPipeline


class DepthMixingBlock(TransformerBlock):
    def setup_mechanism(self, mechanism, pipeline: DepthPipeline) -> None:
        self.mechanism, self.pipeline = mechanism, pipeline
        self.first_layer = self.layers[0].layer_number - 1  # 0-based global index
        self.stage = pipeline.geometry.stage_of_first_layer(self.first_layer)
        if self.final_layernorm is not None:  # the stage that ends the decoder also does the final depth mix
            for name, module in mechanism.final_modules(self.config.params_dtype).items():
                self.add_module(name, module)
            mark_replicated(self, mechanism, self.config)

    def _microbatch(self) -> int:
        return getattr(self.layers[0], "current_microbatch", 0) or 0

    def _run_layers(self, state, layer_kwargs):
        mech = self.mechanism
        hosts = [layer.bind(layer_kwargs) for layer in self.layers]
        if not (self.config.recompute_granularity == "full" and self.training):
            return mech.run_layers(hosts, state)
        n = self.config.recompute_num_layers
        uniform = self.config.recompute_method == "uniform"
        start = 0
        while start < len(hosts):
            end = min(start + n, len(hosts)) if uniform else start + 1
            checkpoint = uniform or start < n  # "block": checkpoint the first n layers only
            in_layout = [e.name for e in mech.layout(self.first_layer + start)]
            out_layout = [e.name for e in mech.layout(self.first_layer + end)]

            def run(*tensors, _s=start, _e=end, _in=in_layout, _out=out_layout):
                st = mech.run_layers(hosts[_s:_e], mech.state_from(dict(zip(_in, tensors)), self.first_layer + _s))
                ent = mech.entries(st)
                return tuple(ent[name] for name in _out)

            ent = mech.entries(state)
            args = [ent[name] for name in in_layout]
            outs = tensor_parallel.checkpoint(run, False, *args) if checkpoint else run(*args)
            if isinstance(outs, torch.Tensor):
                outs = (outs,)
            state = mech.state_from(dict(zip(out_layout, outs)), self.first_layer + end)
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
        mech, pipe = self.mechanism, self.pipeline
        with rng:
            state = mech.initial_state(hidden_states) if self.pre_process else \
                pipe.receive(self.stage, self._microbatch(), self.input_tensor)
            state = self._run_layers(state, layer_kwargs)
            if self.final_layernorm is None:
                out = pipe.send(self.stage, self._microbatch(), state)
            else:
                out = self.final_layernorm(mech.final_hidden(state, self))
        return make_viewless_tensor(inp=out, requires_grad=True, keep_graph=True)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # Layers whose parameters differ in shape (DCA's GRNs grow with depth) are checkpointed per layer.
        if not self.mechanism.homogeneous_layers:
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
    """Megatron's GPTModel with a DepthMixingBlock decoder driven by the mechanism."""

    def __init__(self, *args, mechanism, pipeline: DepthPipeline, **kwargs):
        with _decoder_class(DepthMixingBlock):
            super().__init__(*args, **kwargs)
        self.decoder.setup_mechanism(mechanism, pipeline)
