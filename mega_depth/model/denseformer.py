"""DenseFormer (arXiv 2402.02622, docs/mechanisms.md §9): after every p-th block (or sublayer,
`--denseformer-granularity sublayer`), a depth-weighted average (DWA) of the outputs X_j of the blocks so far with j =
i (mod k) replaces the next block's input: Y_i = sum_j alpha_ij X_j. The alphas are plain scalars (no softmax, no
input dependence), initialised to the identity (alpha_ii = 1, others 0), so at init the model is the baseline bit for
bit. Blocks keep their standard pre-norm residual inside. `k x p`-DenseFormer: --denseformer-dilation k,
--denseformer-period p; 1 x 1 is the full model.

The pipeline carries Y_i and every stored X_j a later DWA still reads (docs/mechanisms.md §11); X_j never change
once made, so virtual stages cache them like AttnRes blocks. Only X_j a later DWA reads are kept at all.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor, nn

from .base import Entry, Mechanism, Option, sunk_gradients
from .mixing import dwa_mix, dwa_needed_after, dwa_sources, dwa_units


class DWA(nn.Module):
    """One depth-weighted average over `num_sources` outputs (increasing j): alpha = (0, ..., 0, 1) at init."""

    def __init__(self, num_sources: int, dtype=None):
        super().__init__()
        alpha = torch.zeros(num_sources, dtype=dtype)
        alpha[-1] = 1.0
        self.alpha = nn.Parameter(alpha)


class DenseFormerState:
    """Y (the next unit's input), the stored outputs X_j a later DWA reads, and the next unit (1-based)."""

    def __init__(self, y: Tensor, outputs: Dict[int, Tensor], next_unit: int):
        self.y, self.outputs, self.next_unit = y, dict(outputs), next_unit


class DenseFormer(Mechanism):
    name = "denseformer"
    plain_residual_adds = True
    options = (
        Option("denseformer_dilation", int, 1, "DenseFormer k: a DWA after unit i averages X_j with j = i (mod k)"),
        Option("denseformer_period", int, 1, "DenseFormer p: a DWA after every p-th unit (1 x 1: the full model)"),
        Option("denseformer_granularity", str, "block", "DenseFormer units: blocks (the paper) or sublayers",
               ("block", "sublayer")),
    )
    module_names = ("dwa", "attn_dwa", "mlp_dwa")

    def __init__(self, residual, shape, tp=1, sp=False):
        super().__init__(residual, shape, tp, sp)
        self.k, self.p = residual.denseformer_dilation, residual.denseformer_period
        self.per_sublayer = residual.denseformer_granularity == "sublayer"
        self.num_units = shape.num_sublayers if self.per_sublayer else shape.num_layers

    @classmethod
    def catalogue(cls, num_layers):
        return {"denseformer": {"mechanism": "denseformer", "denseformer_dilation": 1, "denseformer_period": 1}}

    @classmethod
    def validate(cls, cfg, fail):
        r = cfg.residual
        fail(r.denseformer_dilation >= 1, "--denseformer-dilation must be >= 1")
        fail(r.denseformer_period >= 1, "--denseformer-period must be >= 1")

    # --- parameters -------------------------------------------------------------------------------------------
    def _has_dwa(self, unit: int) -> bool:
        return unit >= 1 and unit % self.p == 0

    def _units(self, layer: int):
        """(unit, module name) of a layer: one block, or its two sublayers."""
        if self.per_sublayer:
            return [(2 * layer + 1, "attn_dwa"), (2 * layer + 2, "mlp_dwa")]
        return [(layer + 1, "dwa")]

    def layer_modules(self, layer, dtype=None):
        return {name: DWA(len(dwa_sources(unit, self.k)), dtype) for unit, name in self._units(layer)
                if self._has_dwa(unit)}

    @property
    def homogeneous_layers(self):
        return False  # the DWAs grow with depth, and only every p-th unit has one

    def decays(self, param_name, param):
        return False  # plain scalars, like norm gains

    # --- forward ----------------------------------------------------------------------------------------------
    def initial_state(self, embedding):
        return self._keep(DenseFormerState(embedding, {0: embedding}, 1))

    def _keep(self, state: DenseFormerState) -> DenseFormerState:
        needed = set(dwa_needed_after(state.next_unit - 1, self.num_units, self.k, self.p))
        state.outputs = {j: t for j, t in state.outputs.items() if j in needed}
        return state

    def _finish_unit(self, layer, state: DenseFormerState, x: Tensor, name: str) -> None:
        unit = state.next_unit
        state.outputs[unit] = x
        if self._has_dwa(unit):
            sources = dwa_sources(unit, self.k)
            mixer = getattr(layer, name)
            if self.recorder is not None:
                self.recorder.add("dwa", unit, f"{'sublayer' if self.per_sublayer else 'block'} {unit}",
                                  mixer.alpha.detach().float())
            state.y = self.kernel("dwa_mix", dwa_mix)([state.outputs[j] for j in sources], mixer.alpha)
        else:
            state.y = x
        state.next_unit += 1
        self._keep(state)

    def layer_forward(self, layer, state):
        y = state.y
        if self.per_sublayer:
            self._finish_unit(layer, state, y + layer.attention_sublayer(y), "attn_dwa")
            y = state.y
            self._finish_unit(layer, state, y + layer.mlp_sublayer(y), "mlp_dwa")
        else:
            x = y + layer.attention_sublayer(y)
            self._finish_unit(layer, state, x + layer.mlp_sublayer(x), "dwa")
        return state

    def final_hidden(self, state, decoder):
        return state.y

    def io_units(self, fused=True):
        """The standard residual's, plus per DWA after unit i: reads |S_i| d, writes Y_i, stores X_i
        (docs/mechanisms.md §9)."""
        return 3.0 * self.shape.num_sublayers + sum(len(dwa_sources(i, self.k)) + 2
                                                    for i in dwa_units(self.num_units, self.p))

    def kernel_io_units(self, recompute=True):
        """Per DWA over K stored outputs (a GRN v1 of one instance): forward reads K and writes the average;
        backward reads the average's gradient for the outputs' gradients, and the parameter kernel reads K and it
        once more; each stored output's gradients are summed in the kernels over the DWAs that read it."""
        readers, total = {}, 0.0
        for unit in dwa_units(self.num_units, self.p):
            sources = dwa_sources(unit, self.k)
            total += (len(sources) + 1) + 1 + (len(sources) + 1)
            for j in sources:
                readers[j] = readers.get(j, 0) + 1
        return total + sunk_gradients(readers)

    # --- pipeline payload -------------------------------------------------------------------------------------
    def _unit_at(self, boundary: int) -> int:
        return 2 * boundary if self.per_sublayer else boundary

    def layout(self, boundary):
        unit, d = self._unit_at(boundary), self.shape.hidden_size
        stored = dwa_needed_after(unit, self.num_units, self.k, self.p)
        out = [] if (unit in stored and not self._has_dwa(unit)) else [Entry("y", d, False)]
        return out + [Entry(f"x{j}", d, True) for j in stored]

    def entries(self, state):
        out = {f"x{j}": t for j, t in state.outputs.items()}
        unit = state.next_unit - 1
        if unit not in state.outputs or self._has_dwa(unit):
            out = {"y": state.y, **out}
        return out

    def state_from(self, entries, boundary):
        unit = self._unit_at(boundary)
        outputs = {int(name[1:]): t for name, t in entries.items() if name.startswith("x")}
        y = entries["y"] if "y" in entries else outputs[unit]
        return DenseFormerState(y, outputs, unit + 1)
