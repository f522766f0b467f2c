"""Depth-Attention (arXiv 2606.05014, docs/mechanisms.md §6): inside attention, each layer's values are a softmax mix
over the stored values of earlier candidate layers (scored with this layer's query against their keys, normalised by
this layer's key norm) and its own. The residual stream stays standard; no new parameters. The mixed values replace
the layer's values in attention and in the KV cache.

Candidates of layer l: earlier layers j with j % stride == 0, plus the `window` most recent. The default is the
released 3B model's shape (48 layers, stride 24, window 0), scaled: stride = num_layers // 2, window 0. An earlier
version of the catalogue added window 1; it was dropped so that the named setting is the one the authors trained.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from .base import Entry, Mechanism, Option, norm_outputs_made_again, sunk_gradients
from .mixing import (DEPTH_ATTN_GQA_MODES, depth_attention_candidates, depth_attention_mix,
                     depth_attention_needed_after, depth_attention_weights)


class DepthAttentionState:
    """The residual stream, plus the stored raw keys and mixed values of earlier layers (0-based index)."""

    def __init__(self, hidden: Tensor):
        self.hidden = hidden
        self.raw_keys: Dict[int, Tensor] = {}
        self.values: Dict[int, Tensor] = {}

    def candidates(self, layer: int, stride: int, window: int):
        """([raw key, ...], [value, ...]) of the layers `layer` mixes, or (None, None)."""
        ids = depth_attention_candidates(layer, stride, window)
        if not ids:
            return None, None
        missing = [j for j in ids if j not in self.raw_keys]
        if missing:
            raise RuntimeError(f"depth-attention layer {layer} needs layers {missing}, which were not carried here")
        return [self.raw_keys[j] for j in ids], [self.values[j] for j in ids]

    def store(self, layer: int, raw_key: Tensor, value: Tensor, num_layers: int, stride: int, window: int) -> None:
        """Keep this layer's raw key and mixed value, and drop what no later layer needs. A kept raw key is made
        contiguous once (a key split off the fused QKV projection is a strided view): every later layer's mix
        reads its rows in place, where each would copy a view."""
        keep = set(depth_attention_needed_after(layer, num_layers, stride, window))
        if layer in keep:
            self.raw_keys[layer], self.values[layer] = raw_key.contiguous(), value
        for j in list(self.raw_keys):
            if j not in keep:
                del self.raw_keys[j], self.values[j]


class DepthAttention(Mechanism):
    name = "depth-attention"
    plain_residual_adds = True
    options = (
        Option("depth_attn_stride", int, None, "candidate layers j with j % stride == 0 (omit: num_layers // 2, "
               "the released 3B model's 48 / 24; 0: none, only the window)"),
        Option("depth_attn_window", int, 0, "plus the `window` most recent layers (released model: 0)"),
        Option("depth_attn_gqa", str, "query", "query: per-query-head depth weights and values (the authors' "
               "code; the KV cache holds one value per query head); group: one weight per key-value head from "
               "the mean of its queries (keeps the GQA cache size)", DEPTH_ATTN_GQA_MODES),
    )

    def __init__(self, residual, shape, tp=1, sp=False):
        super().__init__(residual, shape, tp, sp)
        self.stride = self.resolved_stride(residual, shape.num_layers)
        self.window, self.gqa = residual.depth_attn_window, residual.depth_attn_gqa
        hkv = shape.num_query_groups // tp
        hv = (shape.num_attention_heads if self.gqa == "query" else shape.num_query_groups) // tp
        self.kv_width, self.v_width = hkv * shape.head_dim, hv * shape.head_dim
        # Under SP the keys/values are sequence-complete on every TP rank; they travel folded to [s/tp, b, tp*w].
        self.fold = tp if sp else 1

    @staticmethod
    def resolved_stride(residual, num_layers: int) -> int:
        stride = residual.depth_attn_stride
        return max(1, num_layers // 2) if stride is None else stride

    @classmethod
    def catalogue(cls, num_layers):
        return {"depth-attention": {"mechanism": "depth-attention", "depth_attn_stride": max(1, num_layers // 2),
                                    "depth_attn_window": 0}}

    @classmethod
    def validate(cls, cfg, fail):
        r, m = cfg.residual, cfg.model
        fail(r.depth_attn_gqa in DEPTH_ATTN_GQA_MODES,
             f"unknown --depth-attn-gqa {r.depth_attn_gqa!r}; choose one of {', '.join(DEPTH_ATTN_GQA_MODES)}")
        fail(r.depth_attn_stride is None or r.depth_attn_stride >= 0, "--depth-attn-stride must be >= 0 (0: no "
             "strided candidates)")
        fail(r.depth_attn_window >= 0, "--depth-attn-window must be >= 0")
        fail(not m.fused_single_qkv_rope, "--residual depth-attention needs the separate query/key/value tensors "
             "that --fused-single-qkv-rope never materialises; drop --fused-single-qkv-rope")

    @property
    def value_heads_per_query_head(self):
        return self.gqa == "query" and self.shape.num_query_groups < self.shape.num_attention_heads

    # --- forward ------------------------------------------------------------------------------------------------
    def initial_state(self, embedding):
        return DepthAttentionState(embedding)

    def layer_forward(self, layer, state):
        index = layer.layer_index

        mix = self.kernel("depth_attention_mix", depth_attention_mix)
        # the host's norms inside the mix's kernels, where they can hand their weights to an op: this layer's query
        # and key norms and the candidates' key norm, or the candidates' alone
        mix_qk = getattr(self.kernels, "depth_attention_mix_qk_normed", None) if self.fused else None
        mix_normed = getattr(self.kernels, "depth_attention_mix_normed", None) if self.fused else None

        def value_mixer(raw_query, raw_key, value, query_norm, key_norm):
            cand_raw, cand_values = state.candidates(index, self.stride, self.window)
            n = 0 if cand_raw is None else len(cand_raw)

            def normalise_and_mix(raw_query, raw_key, value, *candidates):
                """-> (query, key, mixed values): the attention reads the normalised query and key from here, so
                each norm runs once."""
                if n and mix_qk is not None and hasattr(query_norm, "folded") and hasattr(key_norm, "folded"):
                    # through both modules' calls (their hooks run): the attention's gradients of the normalised
                    # query and key join the mix's in its backward kernel, not in autograd, and no norm kernel runs
                    folded = query_norm.folded(lambda wq, eq: key_norm.folded(lambda wk, ek: mix_qk(
                        wq, eq, wk, ek, raw_query, raw_key, value, list(candidates[:n]), list(candidates[n:]),
                        self.gqa), raw_key), raw_query)
                    if folded is not None:
                        return folded
                query, key = query_norm(raw_query), key_norm(raw_key)
                if n == 0:
                    return query, key, mix(query, key, value, None, None, self.gqa)
                if mix_normed is not None and hasattr(key_norm, "folded"):
                    # no normalised candidate key is made, kept, made again or summed over its readers' gradients
                    mixed = key_norm.folded(lambda weight, eps: mix_normed(
                        weight, eps, query, key, value, list(candidates[:n]), list(candidates[n:]), self.gqa), key)
                    if mixed is not None:
                        return query, key, mixed
                # lists, not stacks: the op reads each candidate in place (a stack and its backward copy them all)
                keys, values = [key_norm(k) for k in candidates[:n]], list(candidates[n:])
                if self.recorder is not None:
                    self.recorder.add("depth-attention", index, f"layer {index}",
                                      depth_attention_weights(query, torch.stack(keys + [key]), self.gqa))
                return query, key, mix(query, key, value, keys, values, self.gqa)

            # On the fast path, what this mix makes (the normalised query and key of this layer, and its candidates'
            # keys where the host's norm is not folded into the mix) is recomputed in backward instead of kept: only
            # the raw projections, this layer's value and the stored candidates stay (the attention keeps its
            # rotated query and key, not these).
            # The host's fused norms remake their outputs where the mix saves them (no checkpointed region: no
            # second forward under autograd, no nested backward pass; norm_outputs_made_again).
            tensors = (raw_query, raw_key, value) + (() if n == 0 else (*cand_raw, *cand_values))
            made_again = (norm_outputs_made_again((query_norm, key_norm), raw_key) if self.recomputes and self.fused
                          else None)
            if made_again is not None:
                with made_again:
                    query, key, mixed = normalise_and_mix(*tensors)
            elif self.recomputes:
                query, key, mixed = self.recompute(normalise_and_mix, *tensors)
            else:
                query, key, mixed = normalise_and_mix(*tensors)
            state.store(index, raw_key, mixed, self.shape.num_layers, self.stride, self.window)
            return query, key, mixed

        x = state.hidden
        x = x + layer.attention_sublayer(x, value_mixer=value_mixer)
        state.hidden = x + layer.mlp_sublayer(x)
        return state

    def final_hidden(self, state, decoder):
        return state.hidden

    def io_units(self, fused=True):
        """The standard residual's, plus per candidate its stored key and value read (per query head or per
        group), plus per layer the mixed values' extra width over the plain values (per-query-head values)."""
        s = self.shape
        kv = s.num_query_groups / s.num_attention_heads
        v = (s.num_attention_heads if self.gqa == "query" else s.num_query_groups) / s.num_attention_heads
        cands = sum(len(depth_attention_candidates(l, self.stride, self.window)) for l in range(s.num_layers))
        return 3.0 * s.num_sublayers + cands * (kv + v) + s.num_layers * (v - kv)

    def kernel_io_units(self, recompute=True):
        """Per layer with C candidates, the value mix reads the query, key and value, the candidates' raw keys
        (normalised by this layer's key norm inside the kernel) and stored values, and writes the mixed values,
        once; backward reads them again and the mixed values' gradient and writes the query's, key's and value's
        gradients; a stored key's and value's gradients are summed in the kernels over the layers that read them.
        With the attention's q/k norms (`qk_norm`), the query and key it reads are raw and normalised in the
        kernels too (nothing is made again: no norm runs outside the mix): forward also writes the normalised query
        and key for the attention; backward also reads the attention's gradients of them, and a second launch takes
        the sums through the norms (reads the raw rows, reads and writes their gradients). Widths in units of d:
        the query 1, a key or value hkv/hq, a mixed value hq/hq per query head (1) or per group."""
        s = self.shape
        kw = s.num_query_groups / s.num_attention_heads
        vw = (s.num_attention_heads if self.gqa == "query" else s.num_query_groups) / s.num_attention_heads
        normed = (1 + kw) if s.qk_norm else 0.0  # the query and key rows
        readers, total = {}, 0.0
        for layer in range(s.num_layers):
            cands = depth_attention_candidates(layer, self.stride, self.window)
            c = len(cands)
            if not c:
                continue  # the value alone: no kernel
            forward = 1 + 2 * kw + c * (kw + vw) + vw + normed
            # the mix's backward (and the attention's gradients of the normalised rows), then the norms' launch
            backward = (1 + 2 * kw + c * (kw + vw) + vw) + (1 + 2 * kw) + normed + 3 * normed
            total += forward + backward
            for j in cands:
                readers[j] = readers.get(j, 0) + 1
        return total + sunk_gradients(readers, lambda j: kw + vw)

    def training_io_units(self, fused=True):
        """As the base's, less the work of the host's q/k norms that the fused kernels do in their place (counted in
        kernel_io_units): the baseline's step normalises the query and key of every layer too (forward: read the raw
        rows, write the normalised; backward: read the raw rows and the gradient, write the raw rows'), so the bound
        keeps only the traffic Depth-Attention adds."""
        units = super().training_io_units(fused)
        s = self.shape
        if fused and s.qk_norm:
            mixing_layers = sum(1 for layer in range(s.num_layers)
                                if depth_attention_candidates(layer, self.stride, self.window))
            units -= 5 * (1 + s.num_query_groups / s.num_attention_heads) * mixing_layers
        return units

    # --- pipeline payload ---------------------------------------------------------------------------------------
    def layout(self, boundary):
        out = [Entry("hidden", self.shape.hidden_size, False)]
        for j in depth_attention_needed_after(boundary - 1, self.shape.num_layers, self.stride, self.window):
            out.append(Entry(f"k{j}", self.fold * self.kv_width, True))
            out.append(Entry(f"v{j}", self.fold * self.v_width, True))
        return out

    def entries(self, state):
        out = {"hidden": state.hidden}
        for j in state.raw_keys:
            out[f"k{j}"], out[f"v{j}"] = state.raw_keys[j], state.values[j]
        return out

    def state_from(self, entries, boundary):
        state = DepthAttentionState(entries["hidden"])
        for name, t in entries.items():
            if name[0] == "k":
                state.raw_keys[int(name[1:])] = t
            elif name[0] == "v":
                state.values[int(name[1:])] = t
        return state

    def flat(self, name, t):
        if name == "hidden":
            return t
        s, b = t.shape[:2]
        t = t.reshape(s, b, -1)  # [s, b, heads * hn]
        if self.fold > 1:  # [s, b, w] -> [s/tp, b, tp * w], position-major chunks
            t = t.view(self.fold, s // self.fold, b, -1).permute(1, 2, 0, 3).reshape(s // self.fold, b, -1)
        return t

    def unflat(self, name, t):
        if name == "hidden":
            return t
        s_local, b = t.shape[:2]
        if self.fold > 1:
            t = t.view(s_local, b, self.fold, -1).permute(2, 0, 1, 3).reshape(self.fold * s_local, b, -1)
        return t.view(t.shape[0], b, -1, self.shape.head_dim)
