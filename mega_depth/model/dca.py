"""DeepCrossAttention (arXiv 2502.06785, docs/mechanisms.md §5): generalised residuals (GRNs) over the stack of the
embedding and earlier block outputs feed attention's query, key and value; f_t = a + MLP(norm(a + q_in)). k-DCA keeps
the embedding, the sum of older outputs and the last k outputs. A final GRN over the whole stack feeds the final norm.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor, nn

from .base import Entry, Mechanism, Option, sunk_gradients
from .mixing import GRN_VERSIONS, dca_num_sources, grn_apply_sources, grn_mean_weights


class GRN(nn.Module):
    """`count` independent GRN instances over a K-entry stack (DCA uses 3 for q/k/v, 1 for the final mix).

    At initialisation (bias ones, proj zero) every instance returns sum_i G[i]: the ordinary residual stream.
    """

    def __init__(self, hidden_size: int, num_sources: int, version: str = "v3", count: int = 1, dtype=None):
        super().__init__()
        if version not in GRN_VERSIONS:
            raise ValueError(f"unknown GRN version {version!r}; choose one of {', '.join(GRN_VERSIONS)}")
        self.version = version
        self.num_sources = num_sources
        shape = (count, num_sources) if version == "v1" else (count, hidden_size, num_sources)
        self.bias = nn.Parameter(torch.ones(shape, dtype=dtype))
        self.proj = nn.Parameter(torch.zeros(count, hidden_size, dtype=dtype)) if version == "v3" else None


class DCAState:
    """The DCA stack: the embedding, (k-DCA) the sum of older block outputs, and the recent block outputs.
    `next_block` is the 1-based transformer block that reads the stack next."""

    def __init__(self, last_k: Optional[int], embedding: Tensor, summed: Optional[Tensor], recent: List[Tensor],
                 next_block: int):
        self.last_k = last_k
        self.embedding = embedding
        self.summed = summed
        self.recent = list(recent)
        self.next_block = next_block

    def entries(self) -> List[Tensor]:
        return [self.embedding] + ([self.summed] if self.summed is not None else []) + self.recent

    def stack(self) -> Tensor:
        return torch.stack(self.entries())

    def record(self, block_output: Tensor) -> None:
        self.recent.append(block_output)
        if self.last_k is not None and len(self.recent) > self.last_k:
            oldest = self.recent.pop(0)
            self.summed = oldest if self.summed is None else self.summed + oldest
        self.next_block += 1

    @staticmethod
    def has_sum(next_block: int, last_k: Optional[int]) -> bool:
        return last_k is not None and next_block - 1 > last_k

    @staticmethod
    def num_recent(next_block: int, last_k: Optional[int]) -> int:
        produced = next_block - 1
        return produced if last_k is None else min(produced, last_k)


class DCA(Mechanism):
    name = "dca"
    plain_residual_adds = True
    options = (
        Option("dca_last_k", int, None, "k-DCA: keep the last k block outputs plus the sum of the older ones "
               "(omit for all)"),
        Option("dca_grn", str, "v3", "GRN form: v1 one scalar per source, v2 a d-vector per source, v3 plus an "
               "input-dependent ReLU term", GRN_VERSIONS),
    )
    module_names = ("grn_qkv", "final_grn")
    runs_on_fused_norm_qkv = False  # three different inputs to one norm + QKV projection

    def __init__(self, residual, shape, tp=1, sp=False):
        super().__init__(residual, shape, tp, sp)
        self.last_k, self.version = residual.dca_last_k, residual.dca_grn

    @classmethod
    def catalogue(cls, num_layers):
        return {"dca": {"mechanism": "dca"}, "dca-2": {"mechanism": "dca", "dca_last_k": 2}}

    @classmethod
    def validate(cls, cfg, fail):
        r, m = cfg.residual, cfg.model
        fail(r.dca_grn in GRN_VERSIONS, f"unknown --dca-grn {r.dca_grn!r}; choose one of {', '.join(GRN_VERSIONS)}")
        if r.dca_last_k is not None:
            fail(1 <= r.dca_last_k <= m.num_layers, f"--dca-last-k {r.dca_last_k} must lie in 1..--num-layers "
                 f"({m.num_layers}); omit it to keep all layers")
        fail(not m.fused_single_qkv_rope, "--residual dca needs the separate query/key/value tensors that "
             "--fused-single-qkv-rope never materialises; drop --fused-single-qkv-rope")

    # --- parameters ---------------------------------------------------------------------------------------------
    def layer_modules(self, layer, dtype=None):
        sources = dca_num_sources(layer + 1, self.last_k)
        return {"grn_qkv": GRN(self.shape.hidden_size, sources, self.version, count=3, dtype=dtype)}

    def final_modules(self, dtype=None):
        sources = dca_num_sources(self.shape.num_layers + 1, self.last_k)
        return {"final_grn": GRN(self.shape.hidden_size, sources, self.version, count=1, dtype=dtype)}

    @property
    def homogeneous_layers(self):
        return False  # the GRNs grow with depth (one column per source)

    # --- forward ------------------------------------------------------------------------------------------------
    def _grn(self, grn: GRN, entries: List[Tensor], order: float, label: str) -> Tensor:
        if len(entries) != grn.num_sources:
            raise ValueError(f"GRN built for {grn.num_sources} sources got a stack of {len(entries)}")
        if self.recorder is not None:  # mean over the q/k/v instances
            self.recorder.add("dca", order, label,
                              grn_mean_weights(torch.stack(entries), grn.bias, grn.proj, grn.version).mean(0))
        return self.kernel("grn_apply_sources", grn_apply_sources)(entries, grn.bias, grn.proj, grn.version)

    def initial_state(self, embedding):
        return DCAState(self.last_k, embedding, None, [], 1)

    def layer_forward(self, layer, state):
        t = layer.layer_index + 1

        def qkv_inputs(*entries):  # [3, *, d]: q_in, k_in, v_in
            return self._grn(layer.grn_qkv, list(entries), t, f"block {t} q/k/v")

        if self.recomputes:  # the three inputs and their norms are recomputed in backward, not kept: ~3-4 d per layer
            a, q_in = layer.attention_sublayer_recomputed(qkv_inputs, state.entries(), remakes=self.fused)
        else:
            q_in, k_in, v_in = qkv_inputs(*state.entries()).unbind(0)
            a = layer.attention_sublayer(q_in, k_in, v_in)
        state.record(a + layer.mlp_sublayer(a + q_in))  # f_t = a + m; the block input is not added
        return state

    def final_hidden(self, state, decoder):
        # squeeze, a view: the backward of [0] would zero-fill a whole [1, N, d] gradient
        return self._grn(decoder.final_grn, state.entries(), 1e9, "final").squeeze(0)

    def io_units(self, fused=True):
        L, k, total = self.shape.num_layers, self.last_k, 0.0
        for t in range(1, L + 2):
            total += dca_num_sources(t, k) + (3 if t <= L else 1)  # read the stack, write q/k/v inputs (final: one)
            if t <= L:
                total += 6 + (3 if k is not None and t > k + 1 else 0)  # a + q_in, f = a + m; k-DCA's running sum
        return total

    def kernel_io_units(self, recompute=True):
        """Per block, the GRN over its K stack entries for q/k/v (3 outputs; run again in the recomputation) and the
        final GRN (1 output): forward reads K and writes the outputs; backward (kernels/grn.py) reads K and the
        outputs' gradients for v3's gates, the outputs' gradients again for the entries' gradients, and the
        parameter kernel reads K and them once more; each entry's gradients are summed in the kernels over every
        block that reads it (k-DCA's running sum is a new tensor each time it grows)."""
        L, k = self.shape.num_layers, self.last_k
        gates = self.version == "v3"
        recent, summed, readers, total = [], None, {}, 0.0
        for t in range(1, L + 2):
            entries = ["x"] + ([summed] if summed is not None else []) + recent
            outputs = 3 if t <= L else 1
            backward = (len(entries) + outputs if gates else 0) + outputs + (len(entries) + outputs)
            total += (2 if recompute and t <= L else 1) * (len(entries) + outputs) + backward
            for e in entries:
                readers[e] = readers.get(e, 0) + 1
            recent.append(f"f{t}")
            if k is not None and len(recent) > k:
                oldest = recent.pop(0)
                summed = oldest if summed is None else f"sum{t}"
        return total + sunk_gradients(readers)

    # --- pipeline payload ---------------------------------------------------------------------------------------
    def layout(self, boundary):
        t, d = boundary + 1, self.shape.hidden_size  # t: the next 1-based block
        out = [Entry("x", d, True)]
        if DCAState.has_sum(t, self.last_k):
            out.append(Entry("sum", d, False))
        produced, recent = t - 1, DCAState.num_recent(t, self.last_k)
        return out + [Entry(f"f{j}", d, True) for j in range(produced - recent + 1, produced + 1)]

    def entries(self, state):
        out = {"x": state.embedding}
        if state.summed is not None:
            out["sum"] = state.summed
        produced = state.next_block - 1
        for i, f in enumerate(state.recent):
            out[f"f{produced - len(state.recent) + 1 + i}"] = f
        return out

    def state_from(self, entries, boundary):
        recent = [entries[e.name] for e in self.layout(boundary) if e.name.startswith("f")]
        return DCAState(self.last_k, entries["x"], entries.get("sum"), recent, boundary + 1)
