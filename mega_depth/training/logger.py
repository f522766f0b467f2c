"""Rank-0 logging: TensorBoard scalars (loss, perplexity, lr, grad norm, tokens/s, memory) and depth heatmaps."""

from __future__ import annotations

import math
import os

from mega_depth.config import Config


class Logger:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.writer = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(cfg.logging.output_dir, "tensorboard"))

    def step(self, record: dict, memory_gb: float, state=None) -> None:
        if self.writer is None:
            return
        step = record["step"]
        w = self.writer
        w.add_scalar("train/loss", record["loss"], step)
        w.add_scalar("train/perplexity", math.exp(min(record["loss"], 50.0)), step)
        w.add_scalar("train/lr", record["lr"], step)
        w.add_scalar("train/grad_norm", record["grad_norm"], step)
        w.add_scalar("perf/tokens_per_s", record["tokens_per_s"], step)
        w.add_scalar("perf/memory_gb", memory_gb, step)
        if "val_loss" in record:
            w.add_scalar("val/loss", record["val_loss"], step)
            w.add_scalar("val/perplexity", record["val_ppl"], step)

    def heatmap(self, rows, step: int) -> str:
        """Save the depth-weight heatmap as PNG (and to TensorBoard); returns the PNG path."""
        from mega_depth.training.depth_weights import heatmap_figure

        r = self.cfg.residual
        fig = heatmap_figure(rows, f"{r.residual} depth weights, step {step}")
        path = os.path.join(self.cfg.logging.output_dir, "heatmaps", f"depth_weights_step{step:07d}.png")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=110)
        if self.writer is not None:
            self.writer.add_figure("depth_weights", fig, step)
        import matplotlib.pyplot as plt

        plt.close(fig)
        return path

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
