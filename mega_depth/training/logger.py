"""Where a run's records go (rank 0): metrics.jsonl, the console, TensorBoard, Weights & Biases, heatmaps, and the
resolved config.

- `--output-dir/config.yaml`: the run's full resolved configuration, loadable with --config.
- `metrics.jsonl`: one strict-JSON record per step (a non-finite value is null, and "nonfinite" names it).
- The console: one line per --log-interval with the interval's averages (loss, ms/step, tokens/s), % done, memory,
  ETA and, on a GPU, MFU (training/report.py: IntervalMeter).
- TensorBoard (`--output-dir/tensorboard`) and W&B (`--wandb-project`): the same scalars and heatmaps.
- `run.json`: the run id and --save folder of the run the folder's records belong to (check_output_dir).
On resume, records past the resumed step (left by the interrupted run) are dropped from metrics.jsonl and
TensorBoard. Another run's records are never dropped: a new run into a folder that holds them is refused
(--overwrite-output-dir replaces them).
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from typing import List, Optional

from mega_depth.config import Config, ConfigError, to_dict
from mega_depth.training.report import IntervalMeter


def config_yaml(cfg: Config) -> str:
    """The resolved config as YAML that --config reads back (sections, keys as the flags without dashes)."""
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


RUN_RECORD = "run.json"


def check_output_dir(cfg: Config, run_id: str, start_step: int) -> None:
    """ConfigError (one line) if --output-dir holds the records of another run: one that is neither this run (the
    same run id: a resume) nor an earlier attempt of this job (the same --save folder: a resubmission that starts
    again), unless --overwrite-output-dir."""
    out = cfg.logging.output_dir
    metrics = os.path.join(out, "metrics.jsonl")
    if cfg.logging.overwrite_output_dir or not os.path.isfile(metrics) or os.path.getsize(metrics) == 0:
        return
    try:
        with open(os.path.join(out, RUN_RECORD)) as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        recorded = None  # written before run records, or damaged
    if recorded is None and start_step > 0:
        return  # a resume into a folder from before run records: as before
    if isinstance(recorded, dict):
        save = cfg.checkpoint.save and os.path.realpath(cfg.checkpoint.save)
        if recorded.get("run_id") == run_id or (save and recorded.get("save") == save):
            return
    with open(metrics) as f:
        steps = sum(1 for line in f if line.strip())
    who = f"run {recorded.get('run_id')}" if isinstance(recorded, dict) else "another run"
    raise ConfigError(f"--output-dir {out} holds the metrics of {who} ({steps} records in metrics.jsonl); pick "
                      "a new --output-dir, resume that run (--load its checkpoint), or pass --overwrite-output-dir "
                      "to replace its records")


class Logger:
    def __init__(self, cfg: Config, start_step: int, meter: IntervalMeter, run_id: str = ""):
        self.cfg, self.meter = cfg, meter
        out = cfg.logging.output_dir
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.yaml"), "w") as f:
            f.write(config_yaml(cfg))
        with open(os.path.join(out, RUN_RECORD), "w") as f:
            save = cfg.checkpoint.save and os.path.realpath(cfg.checkpoint.save)
            json.dump({"run_id": run_id, "save": save or None}, f)
        self.metrics_path = os.path.join(out, "metrics.jsonl")
        _truncate_metrics(self.metrics_path, start_step)
        self.interval_losses: List[float] = []
        self.writer = None
        if cfg.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # the XLA test environment has no tensorboard; metrics.jsonl has everything
                SummaryWriter = None
            if SummaryWriter is not None:
                self.writer = SummaryWriter(os.path.join(out, "tensorboard"), purge_step=start_step + 1)
        self.wandb = _wandb_run(cfg) if cfg.logging.wandb_project else None

    # --- per step ---------------------------------------------------------------------------------------------------
    def step(self, record: dict, memory_gb: float) -> None:
        try:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            free = shutil.disk_usage(os.path.dirname(self.metrics_path)).free
            raise ConfigError(f"the disk is full: writing {self.metrics_path} failed ({e.strerror}) with {free} bytes "
                              "free; free space there (or pick another --output-dir) and resume from the last "
                              "checkpoint") from None
        done = record["step"]
        if math.isfinite(record["loss"]):
            self.interval_losses.append(record["loss"])
        if done % self.cfg.logging.log_interval == 0 or "val_loss" in record or record.get("skipped") \
                or done == self.meter.total_steps:
            self._console(record, memory_gb)
        scalars = {"train/loss": record["loss"], "train/perplexity": math.exp(min(record["loss"], 50.0)),
                   "train/lr": record["lr"], "train/grad_norm": record["grad_norm"],
                   "perf/tokens_per_s": record["tokens_per_s"], "perf/memory_gb": memory_gb,
                   "data/consumed_samples": record["consumed_samples"]}
        if "val_loss" in record:
            scalars.update({"val/loss": record["val_loss"], "val/perplexity": record["val_ppl"]})
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, done)
        if self.wandb is not None:
            self.wandb.log(scalars, step=done)

    def _console(self, record: dict, memory_gb: float) -> None:
        done, total = record["step"], self.meter.total_steps
        losses, self.interval_losses = self.interval_losses, []
        loss = sum(losses) / len(losses) if losses else float("nan")
        line = (f"step {done:>6}/{total} ({100 * done / total:5.1f}%) | loss {loss:.6f} | lr {record['lr']:.3e} | "
                f"grad norm {record['grad_norm']:.4f} | {self.meter.line(done)} | mem {memory_gb:.2f} GB")
        if "moe_load_balancing_loss" in record:
            line += f" | lb loss {record['moe_load_balancing_loss']:.4f}"
        if "moe_load_max_over_mean" in record:
            line += f" | expert load max/mean {record['moe_load_max_over_mean']:.2f}"
        if "val_loss" in record:
            line += f" | val loss {record['val_loss']:.4f} | val ppl {record['val_ppl']:.2f}"
        print(line + (" | skipped (non-finite loss)" if record.get("skipped") else ""), flush=True)

    # --- mixture of experts ----------------------------------------------------------------------------------------
    def routing(self, routing: dict, step: int) -> None:
        """Per MoE layer: the load-balancing loss, the load imbalance and the tokens-per-expert histogram
        (moe/...)."""
        from mega_depth.training.report import load_imbalance

        scalars = {}
        for layer, counts in routing["tokens_per_expert"].items():
            scalars[f"moe/load_max_over_mean/layer_{layer}"] = load_imbalance(counts)
        for layer, value in (routing.get("load_balancing_loss") or {}).items():
            scalars[f"moe/load_balancing_loss/layer_{layer}"] = value
        if self.writer is not None:
            import numpy as np

            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
            for layer, counts in routing["tokens_per_expert"].items():
                # one sample per expert at its index, weighted by its tokens: the load's shape over experts
                self.writer.add_histogram_raw(
                    f"moe/tokens_per_expert/layer_{layer}", min=0, max=len(counts) - 1, num=sum(counts),
                    sum=float(np.dot(range(len(counts)), counts)),
                    sum_squares=float(np.dot(np.arange(len(counts)) ** 2, counts)),
                    bucket_limits=[i + 0.5 for i in range(len(counts))], bucket_counts=counts, global_step=step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def expert_load(self, load: dict, step: int):
        """The expert-load heatmap (MoE layers x experts, of the last logging interval) beside the depth-weight
        heatmaps: a PNG and TensorBoard's moe/expert_load. Returns the path (None without matplotlib)."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        from mega_depth.training.heatmaps import expert_load_figure

        fig = expert_load_figure(load, f"expert load (tokens / mean over experts), steps to {step}")
        path = os.path.join(self.cfg.logging.output_dir, "heatmaps", f"expert_load_step{step:07d}.png")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=110)
        if self.writer is not None:
            self.writer.add_figure("moe/expert_load", fig, step)
        plt.close(fig)
        return path

    # --- heatmaps ---------------------------------------------------------------------------------------------------
    def heatmaps(self, figures: dict, step: int) -> List[str]:
        """One PNG (and TensorBoard / W&B image) per recorded figure; returns the paths."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:  # e.g. a TPU VM's minimal environment: training goes on without pictures
            print("matplotlib is not installed: depth-weight heatmaps skipped (pip install matplotlib)", flush=True)
            return []
        from mega_depth.model.base import STATS
        from mega_depth.training.heatmaps import heatmap_figure

        paths = []
        for name, rows in sorted(figures.items()):
            if name.endswith(STATS):
                self._depth_stats(name[: -len(STATS)], rows, step)
                continue
            fig = heatmap_figure(rows, f"{name} depth weights, step {step}", name)
            path = os.path.join(self.cfg.logging.output_dir, "heatmaps", f"{name}_step{step:07d}.png")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fig.savefig(path, dpi=110)
            if self.writer is not None:
                self.writer.add_figure(f"depth_weights/{name}", fig, step)
            if self.wandb is not None:
                import wandb

                self.wandb.log({f"depth_weights/{name}": wandb.Image(path)}, step=step)
            plt.close(fig)
            paths.append(path)
        return paths

    def _depth_stats(self, figure: str, rows: dict, step: int) -> None:
        """Per reader and averaged over readers: the softmax's entropy and logit spread (saturation shows as
        entropy near 0 and a growing spread), as scalars depth_stats/<figure>/<stat>/<reader>."""
        from mega_depth.model.base import STAT_NAMES

        scalars = {}
        for i, stat in enumerate(STAT_NAMES):
            for (_, label), values in rows.items():
                scalars[f"depth_stats/{figure}/{stat}/{label.replace(' ', '_')}"] = values[i]
            scalars[f"depth_stats/{figure}/{stat}/mean"] = sum(v[i] for v in rows.values()) / len(rows)
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(cfg: Config):
    """A W&B run with Megatron-LM's flags: --wandb-project, --wandb-exp-name, --wandb-save-dir (WANDB_MODE=offline
    writes local files only)."""
    import wandb  # Config.validate checked that it is installed

    lg = cfg.logging
    save_dir = lg.wandb_save_dir or lg.output_dir
    os.makedirs(save_dir, exist_ok=True)
    return wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name or os.path.basename(
        os.path.abspath(lg.output_dir)), dir=save_dir, config=to_dict(cfg))


def strict_json(record: dict) -> dict:
    """A metrics record that strict JSON parsers accept: a non-finite number becomes null and the record's
    "nonfinite" field names it with its value ("nan", "inf", "-inf")."""
    bad = {k: str(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
    if not bad:
        return record
    return {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}


def _truncate_metrics(path: str, start_step: int) -> None:
    """Keep only the records up to `start_step` (a resumed run rewrites the steps after it)."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= start_step:
                kept.append(line)
        except (ValueError, KeyError):
            continue  # a line cut by a kill
    if len(kept) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)


__all__ = ["Logger", "check_output_dir", "config_yaml", "strict_json"]
