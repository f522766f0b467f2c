"""What each layer reads from which source: mean depth-mixing weights on a probe batch, gathered to rank 0 and
drawn as a heatmap (rows: readers in depth order; columns: sources; blank where a source does not exist yet)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from mega_depth import mixing
from mega_depth.megatron.builder import global_param_name


def _readers(state) -> Dict[int, Tuple[float, str]]:
    """id(mixer module) -> (sort key, row label) for this rank's chunks."""
    out = {}
    for chunk in state.model:
        module = getattr(chunk, "module", chunk)
        if not hasattr(module.decoder, "provider"):
            continue
        first = module.decoder.layers[0].layer_number - 1
        for name, sub in module.named_modules():
            if not isinstance(sub, (mixing.AttnResMixer, mixing.GRN)):
                continue
            name = global_param_name(name, first)
            if "final" in name:
                out[id(sub)] = (1e9, "final")
                continue
            layer = int(name.split(".")[2])
            if "attn_mixer" in name:
                out[id(sub)] = (2 * layer + 1, f"sublayer {2 * layer + 1} (attn {layer})")
            elif "mlp_mixer" in name:
                out[id(sub)] = (2 * layer + 2, f"sublayer {2 * layer + 2} (mlp {layer})")
            else:
                out[id(sub)] = (layer + 1, f"block {layer + 1} q/k/v")
    return out


def collect(state, microbatches: List[dict], run_forward) -> Optional[List[Tuple[float, str, List[float]]]]:
    """Run a forward-only pass with recording on (collective; a whole step's micro-batches, which interleaved
    schedules need); rank 0 gets [(order, label, weights)] of the last micro-batch, the others None."""
    readers = _readers(state)
    with mixing.record_depth_weights() as recorded:
        run_forward(state, microbatches)
    rows = []
    for key, weights in recorded.items():
        if isinstance(key, tuple):  # ("depth-attention", layer)
            rows.append((key[1], f"layer {key[1]}", weights.tolist()))
        elif id(key) in readers:
            order, label = readers[id(key)]
            rows.append((order, label, weights.tolist()))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, rows)
    if torch.distributed.get_rank() != 0:
        return None
    unique = {label: (order, label, w) for part in gathered for order, label, w in part}
    return sorted(unique.values())


def heatmap_figure(rows, title: str):
    """A matplotlib figure: rows are readers, columns sources (depth order), NaN-padded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    width = max(len(w) for _, _, w in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, (_, _, w) in enumerate(rows):
        grid[i, : len(w)] = w
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * width + 2), max(3, 0.3 * len(rows) + 1.5)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(rows)), [label for _, label, _ in rows], fontsize=7)
    ax.set_xlabel("source (depth order; last = newest / self)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig
