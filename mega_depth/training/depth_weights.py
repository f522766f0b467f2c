"""Depth-weight heatmaps: what each reader (a sublayer, a layer's q/k/v, the output aggregation) takes from which
source. A mechanism records mean weights while its `recorder` is set (mega_depth/model/base.py: Recorder); the
backend runs the probe and gathers the figures to rank 0; this draws one figure."""

from __future__ import annotations

from typing import Dict, List, Tuple


def heatmap_figure(rows: Dict[Tuple[float, str], List[float]], title: str):
    """A matplotlib figure: rows are readers in depth order, columns sources (NaN where a source does not exist)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ordered = sorted(rows.items())
    width = max(len(w) for _, w in ordered)
    grid = np.full((len(ordered), width), np.nan)
    for i, (_, w) in enumerate(ordered):
        grid[i, : len(w)] = w
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * width + 2), max(3, 0.3 * len(ordered) + 1.5)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(ordered)), [label for (_, label), _ in ordered], fontsize=7)
    ax.set_xlabel("source (depth order; last = newest / self)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig
