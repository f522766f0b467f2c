"""Quality for the same compute: every mechanism trained on the embedded corpus with the same model size, tokens,
data order and schedule, over several seeds.

    python tools/bench_quality.py                                  # CPU default: ~50 min on 2 idle cores
    python tools/bench_quality.py --num-layers 12 --hidden-size 256 --seq-length 256 --global-batch-size 32 \\
        --micro-batch-size 32 --train-iters 200 --lr 2e-3 --seeds 0,1,2 --jobs 6   # one GPU (bf16 there)
    python tools/bench_quality.py --train-iters 20 --num-layers 2 --seeds 0,1 --out-dir /tmp/q   # a quick check
    --jobs N trains N runs at once (small models on one GPU); keep 1 where the wall-clock curves matter.

Runs `python -m mega_depth.train` once per (seed, mechanism), seeds outermost so that slow drifts of the machine
hit every mechanism alike; any trainer flag not listed here passes through (e.g. --lr 1e-3, or a parallel layout
with --nproc-per-node). Writes to --out-dir: one folder per run (metrics.jsonl, TensorBoard, heatmaps),
quality.json (one record per mechanism), loss_vs_tokens.png, loss_vs_time.png and heatmap_<mechanism>.png (the
first seed's depth-mixing weights after training). Prints a table: final validation loss and perplexity, mean and
spread (min..max) over seeds, and the difference to the baseline. The embedded corpus holds ~0.8M tokens (the
CPU default reads it about once); for larger runs pass your own --data-path and --tokenizer-model.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from mega_depth.training.distributed import free_port  # noqa: E402
from mega_depth.catalogue import SETTINGS, mechanism_flags, parse_mechanisms  # noqa: E402
from mega_depth.model.base import TOKEN_SPREAD  # noqa: E402

DATA_PREFIX = os.path.join(ROOT, "data", "processed", "python-docs")
TOKENIZER = os.path.join(ROOT, "data", "processed", "spm.model")



def model_flags(args) -> list:
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
            "--train-iters", str(args.train_iters), "--lr", str(args.lr), "--min-lr", str(args.lr / 10),
            "--lr-warmup-iters", str(max(1, args.train_iters // 20)), "--lr-decay-style", "cosine",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--data-path", args.data_path,
            "--tokenizer-model", args.tokenizer_model, "--split", "95,5,0",
            "--eval-interval", str(args.eval_interval or max(1, args.train_iters // 8)),
            "--eval-iters", str(args.eval_iters), "--log-interval", str(max(1, args.train_iters // 10)),
            # heatmaps and the depth-weight traces (entropy, logit spread) at every evaluation
            "--heatmap-interval", str(args.eval_interval or max(1, args.train_iters // 8))]


def parameter_counts(flags: list) -> dict:
    """Exact parameter count of the model these flags train (the plain-PyTorch twin, built on the meta device)."""
    import torch

    from mega_depth.config import parse_args
    from mega_depth.data.tokenizer import SentencePieceTokenizer
    from mega_depth.model.decoder import CausalLM

    cfg = parse_args(flags)
    dc = cfg.decoder_config(SentencePieceTokenizer(cfg.data.tokenizer_model).vocab_size)
    with torch.device("meta"):
        model = CausalLM(dc)
    mechanism = model.model.mechanism
    total = sum(p.numel() for p in model.parameters())
    mixing = sum(p.numel() for n, p in model.named_parameters() if mechanism.owns(n))
    return {"params": total, "mixing_params": mixing}


def _number(value) -> float:
    return float("nan") if value is None else value


def read_run(run_dir: str) -> dict:
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    evals = [r for r in records if "val_loss" in r]
    if not evals:
        raise SystemExit(f"{run_dir}: no validation loss was logged; raise --train-iters or lower --eval-interval")
    # a skipped step's non-finite loss is null in the file (strict JSON): NaN again here
    return {"tokens": [r["tokens"] for r in records], "loss": [_number(r["loss"]) for r in records],
            "time": [r["train_time_s"] for r in records], "val_tokens": [r["tokens"] for r in evals],
            "val_loss": [r["val_loss"] for r in evals], "final_val_loss": evals[-1]["val_loss"],
            "train_time_s": records[-1]["train_time_s"], "total_tokens": records[-1]["tokens"]}


def smooth(values: list, window: int) -> list:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def summarise(runs: dict, names: list, params: dict) -> list:
    """One record per mechanism: final validation loss/perplexity over seeds, and the gap to the baseline."""
    base = statistics.mean(r["final_val_loss"] for r in runs["standard"].values()) if "standard" in runs else None
    results = []
    for name in names:
        finals = [r["final_val_loss"] for r in runs[name].values()]
        mean = statistics.mean(finals)
        results.append({
            "mechanism": name, "seeds": sorted(runs[name]), "val_loss": finals,
            "val_loss_mean": mean, "val_loss_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "val_loss_min": min(finals), "val_loss_max": max(finals),
            "val_ppl_mean": statistics.mean(math.exp(v) for v in finals),
            "val_ppl_min": math.exp(min(finals)), "val_ppl_max": math.exp(max(finals)),
            "delta_vs_baseline": None if base is None else mean - base,
            "ppl_ratio_vs_baseline": None if base is None else math.exp(mean - base),
            "tokens": runs[name][min(runs[name])]["total_tokens"],
            "train_time_s_mean": statistics.mean(r["train_time_s"] for r in runs[name].values()),
            **params[name],
            "params_ratio_vs_baseline": params[name]["params"] / params["standard"]["params"]
            if "standard" in params else None,
        })
    return results


def depth_stats(run_dir: str) -> dict:
    """{stat: [(step, mean over readers)]} of a run's AttnRes depth-weight traces (TensorBoard), empty if none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    return {stat: [(e.step, e.value) for e in events.Scalars(f"depth_stats/attnres/{stat}/mean")]
            for stat in ("entropy", "logit_std") if f"depth_stats/attnres/{stat}/mean" in tags}


def plot_depth_stats(out_dir: str, names: list, seeds: list, title: str) -> list:
    """depth_stats.png: the softmax's entropy and logit spread over sources (mean over readers) through training,
    per AttnRes setting (band: seeds' min..max); saturation shows as entropy falling to 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = {n: [depth_stats(os.path.join(out_dir, f"{n}-seed{s}")) for s in seeds] for n in names}
    traces = {n: t for n, t in traces.items() if all(t)}
    if not traces:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, stat, label in zip(axes, ("entropy", "logit_std"), ("entropy of the depth weights, nats",
                                                                 "logit spread (std of log w over sources)")):
        for i, (name, runs) in enumerate(traces.items()):
            steps = [step for step, _ in runs[0][stat]]
            values = [[v for _, v in r[stat]] for r in runs]
            ax.plot(steps, [statistics.mean(v[j] for v in values) for j in range(len(steps))], color=f"C{i}",
                    lw=1.4, label=name)
            ax.fill_between(steps, [min(v[j] for v in values) for j in range(len(steps))],
                            [max(v[j] for v in values) for j in range(len(steps))], color=f"C{i}", alpha=0.15, lw=0)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title("mean over sublayers", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "depth_stats.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot(runs: dict, names: list, out_dir: str, title: str) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for x_key, x_label, fname in (("tokens", "training tokens", "loss_vs_tokens.png"),
                                  ("time", "training time (s, steps only)", "loss_vs_time.png")):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for i, name in enumerate(names):
            color = f"C{i}"
            seeds = sorted(runs[name])
            n = min(len(runs[name][s]["loss"]) for s in seeds)
            window = max(1, n // 25)
            curves = [smooth(runs[name][s]["loss"][:n], window) for s in seeds]
            x = [statistics.mean(runs[name][s][x_key][j] for s in seeds) for j in range(n)]
            mean = [statistics.mean(c[j] for c in curves) for j in range(n)]
            ax.plot(x, mean, color=color, lw=1.4, label=name)
            ax.fill_between(x, [min(c[j] for c in curves) for j in range(n)],
                            [max(c[j] for c in curves) for j in range(n)], color=color, alpha=0.15, lw=0)
            if x_key == "tokens":  # validation points: mean over seeds
                vt = runs[name][seeds[0]]["val_tokens"]
                vl = [statistics.mean(runs[name][s]["val_loss"][j] for s in seeds) for j in range(len(vt))]
                ax.plot(vt, vl, "o", color=color, ms=3.5)
        lows = [min(min(r["loss"]) for r in runs[n].values()) for n in names]
        ax.set_ylim(min(lows) - 0.1, min(lows) + 2.5)
        ax.set_xlabel(x_label)
        ax.set_ylabel("training loss (smoothed; band: seeds' min..max)" if x_key == "time" else
                      "training loss (line, band: seeds) / validation loss (dots)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--mechanisms", default=",".join(SETTINGS))
    parser.add_argument("--seeds", default="0,1", help="comma-separated; at least 2 give a spread")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--train-iters", type=int, default=400)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-interval", type=int, default=None, help="default: train-iters / 8")
    parser.add_argument("--eval-iters", type=int, default=8)
    parser.add_argument("--data-path", default=DATA_PREFIX)
    parser.add_argument("--tokenizer-model", default=TOKENIZER)
    parser.add_argument("--nproc-per-node", type=int, default=1, help="launch each run with torchrun")
    parser.add_argument("--fp32", action="store_true", help="fp32 on a GPU too (bf16 is the GPU default)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time (a GPU fits several small ones; wall-clock curves want 1)")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "bench_quality"))
    parser.add_argument("--out", default=None, help="JSON results (default: OUT_DIR/quality.json)")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs in OUT_DIR instead of retraining")
    args, passthrough = parser.parse_known_args(argv)
    names = parse_mechanisms(args.mechanisms)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.data_path == DATA_PREFIX and not os.path.exists(DATA_PREFIX + ".idx"):
        subprocess.run(["bash", os.path.join(ROOT, "tools", "prepare_corpus.sh")], check=True,
                       env=dict(os.environ, PY=sys.executable))
    for path in (args.data_path + ".idx", args.tokenizer_model):
        if not os.path.exists(path):
            raise SystemExit(f"{path} not found: run `bash tools/prepare_corpus.sh` or pass --data-path/"
                             "--tokenizer-model")

    import torch

    base_flags = model_flags(args) + (["--bf16"] if torch.cuda.is_available() and not args.fp32 else []) + passthrough
    params = {name: parameter_counts(base_flags + mechanism_flags(name, args.num_layers)) for name in names}
    os.makedirs(args.out_dir, exist_ok=True)
    runs = {name: {} for name in names}
    started = time.time()
    pending = [(seed, name) for seed in seeds for name in names]
    active = []  # (seed, name, process, start time, log file)
    while pending or active:
        while pending and len(active) < args.jobs:
            seed, name = pending.pop(0)
            run_dir = os.path.join(args.out_dir, f"{name}-seed{seed}")
            if args.reuse and os.path.exists(os.path.join(run_dir, "done")):
                continue
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(run_dir)
            cmd = ["-m", "mega_depth.train"] + base_flags + mechanism_flags(name, args.num_layers) + [
                "--seed", str(seed), "--output-dir", run_dir]
            if args.nproc_per_node > 1:
                cmd = ["-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc_per_node),
                       "--master-addr", "127.0.0.1", "--master-port", str(free_port())] + cmd
            log = open(os.path.join(run_dir, "train.log"), "w")
            proc = subprocess.Popen([sys.executable] + cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            active.append((seed, name, proc, time.time(), log))
        time.sleep(0.5)
        for job in [j for j in active if j[2].poll() is not None]:
            seed, name, proc, t0, log = job
            active.remove(job)
            log.close()
            run_dir = os.path.join(args.out_dir, f"{name}-seed{seed}")
            if proc.returncode != 0:
                for other in active:
                    other[2].kill()
                sys.stderr.write(open(log.name).read()[-4000:])
                raise SystemExit(f"training {name} (seed {seed}) failed with exit status {proc.returncode}; "
                                 f"log: {log.name}")
            open(os.path.join(run_dir, "done"), "w").close()
            print(f"  {name:<16} seed {seed}: {time.time() - t0:6.0f} s", flush=True)
    for seed in seeds:
        for name in names:
            runs[name][seed] = read_run(os.path.join(args.out_dir, f"{name}-seed{seed}"))
    results = summarise(runs, names, params)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    title = (f"{args.num_layers} layers, d={args.hidden_size}, seq {args.seq_length}, "
             f"{results[0]['tokens'] / 1e6:.2f}M tokens, seeds {args.seeds}, {device}")
    plots = plot(runs, names, args.out_dir, title) + plot_depth_stats(args.out_dir, names, seeds, title)
    for name in names:  # what each layer reads, after training (first seed): every figure of the last heatmap step
        folder = os.path.join(args.out_dir, f"{name}-seed{seeds[0]}", "heatmaps")
        pictures = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        last = [p for p in pictures if pictures and p.endswith(pictures[-1].rsplit("_step", 1)[1])]
        primary = [p for p in last if not p.rsplit("_step", 1)[0].endswith(TOKEN_SPREAD)]  # not the spreads
        for picture in last:
            figure = picture.rsplit("_step", 1)[0]
            if len(primary) == 1:  # one figure (and maybe its spread over tokens): named by the setting
                label = name + ("-token-spread" if figure.endswith(TOKEN_SPREAD) else "")
            else:
                label = figure if figure.startswith(name) else f"{name}-{figure}"
            dest = os.path.join(args.out_dir, f"heatmap_{label.replace(' ', '-')}.png")
            shutil.copy(os.path.join(folder, picture), dest)
            plots.append(dest)

    print(f"\nquality on the embedded corpus, {device}: {title}; wall {time.time() - started:.0f} s")
    print(f"{'mechanism':<17}{'params':>10}{'val loss (min..max)':>28}{'val ppl':>9}{'vs baseline':>13}"
          f"{'train s':>9}")
    for r in results:
        delta = "" if r["delta_vs_baseline"] is None else f"{r['delta_vs_baseline']:+.4f}"
        print(f"{r['mechanism']:<17}{r['params']:>10,}{r['val_loss_mean']:>10.4f} "
              f"({r['val_loss_min']:.4f}..{r['val_loss_max']:.4f}){r['val_ppl_mean']:>9.2f}{delta:>13}"
              f"{r['train_time_s_mean']:>9.0f}")
    out = args.out or os.path.join(args.out_dir, "quality.json")
    with open(out, "w") as f:
        json.dump({"device": device, "args": vars(args), "trainer_flags": base_flags, "results": results,
                   "plots": [os.path.relpath(p, args.out_dir) for p in plots]}, f, indent=1)
    print(f"wrote {out} and {len(plots)} plots to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
