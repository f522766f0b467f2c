"""Depth-weight heatmaps: what each reader (a sublayer, a layer's q/k/v, the output aggregation) takes from which
source. A mechanism records mean weights while its `recorder` is set (mega_depth/model/base.py: Recorder); the
backend runs the probe and gathers the figures to rank 0; this draws one figure.

Two kinds of figure: rows of weights over sources (one row per reader, sources in depth order), and, for a stream
mix (HC's A_r, mHC's H_res), one small n x n grid per sublayer (to stream i from stream j).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

COLORBAR_LABEL = "mean depth weight (over tokens)"
SPREAD_LABEL = "std of the depth weight over tokens"  # how much the weights vary with the input
LOAD_LABEL = "tokens routed / the layer's mean over experts"


def heatmap_figure(rows: Dict[Tuple[float, str], list], title: str, name: str = ""):
    """A matplotlib figure of one recorded figure `name` (rows keyed by (order, label), each a [K] list or an
    [n][n] matrix)."""
    import matplotlib

    from mega_depth.model.base import TOKEN_SPREAD

    matplotlib.use("Agg")
    ordered = sorted(rows.items())
    if ordered and isinstance(ordered[0][1][0], list):
        return _stream_grids(ordered, title)
    return _rows(ordered, title, SPREAD_LABEL if name.endswith(TOKEN_SPREAD) else COLORBAR_LABEL)


def expert_load_figure(load: Dict[int, List[float]], title: str):
    """Expert load of an MoE model: one row per MoE layer, each expert's tokens over the layer's mean (1 = even)."""
    import matplotlib

    matplotlib.use("Agg")
    rows = []
    for layer, counts in sorted(load.items()):
        mean = sum(counts) / len(counts) or 1.0
        rows.append(((layer, f"layer {layer}"), [c / mean for c in counts]))
    return _rows(rows, title, LOAD_LABEL, xlabel="expert")


def _rows(ordered: List[Tuple[Tuple[float, str], List[float]]], title: str, colorbar: str = COLORBAR_LABEL,
          xlabel: str = "source (depth order; last = newest / self)"):
    import matplotlib.pyplot as plt
    import numpy as np

    width = max(len(w) for _, w in ordered)
    grid = np.full((len(ordered), width), np.nan)  # NaN where a reader has fewer sources
    for i, (_, w) in enumerate(ordered):
        grid[i, : len(w)] = w
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * width + 2), max(3, 0.3 * len(ordered) + 1.5)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(ordered)), [label for (_, label), _ in ordered], fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=colorbar)
    fig.tight_layout()
    return fig


def _stream_grids(ordered, title: str):
    """One n x n panel per sublayer, on one colour scale: row i, column j = what stream j gives to stream i."""
    import math

    import matplotlib.pyplot as plt
    import numpy as np

    mats = [np.asarray(m, dtype=float) for _, m in ordered]
    n = mats[0].shape[0]
    cols = min(8, len(mats))
    rows = math.ceil(len(mats) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols + 1.2, 1.7 * rows + 0.8), squeeze=False)
    low, high = min(m.min() for m in mats), max(m.max() for m in mats)
    im = None
    for ax, ((_, label), _), m in zip(axes.flat, ordered, mats):
        im = ax.imshow(m, cmap="viridis", vmin=low, vmax=high)
        ax.set_title(label, fontsize=6)
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.tick_params(labelsize=5)
    for ax in list(axes.flat)[len(mats):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("to stream", fontsize=6)
    for ax in axes[-1, :]:
        ax.set_xlabel("from stream", fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.colorbar(im, ax=axes, label=COLORBAR_LABEL, shrink=0.8)
    return fig
