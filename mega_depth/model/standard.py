"""The standard pre-norm residual (docs/mechanisms.md §3): x_{l+1} = x_l + f_l(norm_l(x_l)). The baseline every
mechanism is compared with. On Megatron-core it is Megatron's own layer, unmodified (this class serves the plain
decoder)."""

from __future__ import annotations

from .base import Entry, Mechanism


class Standard(Mechanism):
    name = "standard"
    plain_residual_adds = True
    mixes_depth = False

    @classmethod
    def catalogue(cls, num_layers):
        return {"standard": {"mechanism": "standard"}}

    def initial_state(self, embedding):
        return embedding  # the state is the residual stream itself

    def layer_forward(self, layer, x):
        x = x + layer.attention_sublayer(x)
        return x + layer.mlp_sublayer(x)

    def final_hidden(self, x, decoder):
        return x

    def io_units(self, fused=True):
        return 3.0 * self.shape.num_sublayers

    def kernel_io_units(self, recompute=True):
        return 0.0  # no mixing kernel

    def layout(self, boundary):
        return [Entry("hidden", self.shape.hidden_size, False)]

    def entries(self, x):
        return {"hidden": x}

    def state_from(self, entries, boundary):
        return entries["hidden"]
