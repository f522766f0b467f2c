"""Training throughput and activation memory of every mechanism against the standard residual, in the same run.

    python tools/bench_throughput.py [--hidden-size 512 --num-layers 12 --seq-length 256 --steps 4 --rounds 3]
        [--out bench.json] [--mechanisms standard,attnres-block,...] [--resident pair|all] [--mixing-impl ...]

Per mechanism it reports:
- step time (median of --rounds x --steps timed steps), tokens/s and the ratio to the baseline's step time. The
  baseline is re-measured in the same run, interleaved with the mechanism (--resident pair: one mechanism and the
  baseline resident at a time, for sizes where every model does not fit at once; all: every model built up front,
  rounds over all of them), so drifts of the machine hit both alike;
- the bytes the forward of one training step saves for backward (mega_depth/kernels/saved_bytes.py: unique
  storages, parameters excluded): a machine-independent measure of activation memory, shown on CPU as on a GPU;
- on a GPU: the step's peak memory above what was resident before it;
- the baseline's MFU: tokens/s x model FLOPs per token / the chip's peak (null on CPU). Model FLOPs per token
  (training = 3 x forward, attention counted over the full sequence as Megatron-LM and PaLM do):
      forward = 2 * (L * (d*hq*hn + 2*d*hkv*hn + hq*hn*d + 3*d*ffn) + d*V) + 4 * L * s * hq*hn
- an analytic bound: the step-time ratio the mixing's extra memory traffic alone would cost if nothing hid it, at
  the chip's HBM bandwidth against the baseline at --bound-mfu of its peak (--bound-device's numbers on a CPU):
      ratio >= 1 + extra_units * d * bytes_per_element / bandwidth / (FLOPs per token / (mfu * peak))
  extra_units: the training step's I/O per token (units of d) that the mixing adds over the plain residual's 6 per
  sublayer: each mechanism's own model (Mechanism.training_io_units: its kernels' forward, recomputation and
  backward launch by launch, their source-gradient sums included, which the step trace's recorded launches
  check to 10 %; unfused, 3x the forward's io_units).
One process (the one GPU, or the CPU); run it under torchrun with parallel flags for a multi-process layout,
e.g. `torchrun --nproc-per-node 2 tools/bench_throughput.py --context-parallel-size 2` (rank 0's saved bytes: a
CP2 rank keeps about half of a CP1 rank's).
With --resident pair the --out JSON is rewritten after every pair ("complete": false until the last), so a run cut
short by a time box keeps the pairs it finished.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mega_depth.catalogue import SETTINGS, mechanism_flags, parse_mechanisms, residual_settings  # noqa: E402
from mega_depth.training.flops import DEVICES, device_key, flops_per_token  # noqa: E402

def _mechanism(settings: dict, L: int, d: int, heads: int, groups: int):
    from mega_depth.model.base import NORM_EPSILON, ModelShape
    from mega_depth.model.config import residual_config
    from mega_depth.model.registry import build

    return build(residual_config(settings), ModelShape(L, d, heads, groups, NORM_EPSILON))


def io_units(settings: dict, L: int, d: int, heads: int, groups: int, fused: bool = True) -> float:
    """Forward memory traffic of the depth mixing per token, in units of d: the mechanism's own model
    (Mechanism.io_units in its file), so a new mechanism brings its own."""
    return _mechanism(settings, L, d, heads, groups).io_units(fused)


def training_io_units(settings: dict, L: int, d: int, heads: int, groups: int, fused: bool = True) -> float:
    """A training step's memory traffic of the depth mixing per token, in units of d, as the bound takes it
    (Mechanism.training_io_units: the fused kernels' launch by launch, which the step trace checks)."""
    return _mechanism(settings, L, d, heads, groups).training_io_units(fused)


def mixing_impl(flags) -> str:
    """--mixing-impl among the pass-through flags, else the default of this machine."""
    from mega_depth import kernels

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--mixing-impl", default=None)
    return parser.parse_known_args(flags)[0].mixing_impl or kernels.default_impl()


def saved_bytes(backend, microbatches) -> int:
    """Bytes of the tensors one training step's forward saves for backward (mega_depth/kernels/saved_bytes.py)."""
    from mega_depth.kernels.saved_bytes import saved_for_backward_bytes

    saved = saved_for_backward_bytes(lambda: backend.forward_backward(microbatches),
                                     [p for m in backend.model for p in m.parameters()])
    backend.discard()
    return saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-query-groups", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mechanism per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mechanisms", default=",".join(SETTINGS))
    parser.add_argument("--resident", choices=("pair", "all"), default="pair",
                        help="pair: one mechanism and the baseline at a time; all: every model up front")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the chip's bf16 peak (default: by name)")
    parser.add_argument("--bound-device", default="h200", help="whose peak/bandwidth the bound uses on a CPU")
    parser.add_argument("--bound-mfu", type=float, default=0.4)
    parser.add_argument("--out", default=None)
    args, layout = parser.parse_known_args(argv)

    import torch

    from harness import megatron_run, start, train_step

    world = start()
    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if gpu else f"CPU ({os.cpu_count()} cores)"
    names = ["standard"] + [n for n in parse_mechanisms(args.mechanisms) if n != "standard"]
    L, d, heads = args.num_layers, args.hidden_size, args.num_attention_heads
    groups = args.num_query_groups or heads
    ffn = max(64, int(8 * d / 3 + 63) // 64 * 64)
    total_steps = args.steps * args.rounds + 3

    def build(name):
        flags = ["--mock-data", "--hidden-size", str(d), "--num-layers", str(L), "--num-attention-heads",
                 str(heads), "--num-query-groups", str(groups), "--seq-length", str(args.seq_length),
                 "--vocab-size", "32000", "--micro-batch-size", str(args.micro_batch_size),
                 "--train-iters", str(total_steps), "--lr-decay-style", "constant"] \
            + (["--bf16"] if gpu else []) + mechanism_flags(name, L) + layout
        backend, sampler = megatron_run(flags, total_steps * 64)
        run = {"backend": backend, "sampler": sampler, "times": [], "step": 0, "peak": 0.0,
               "tokens": sampler.global_batch_size * args.seq_length}
        run["saved_bytes"] = saved_bytes(backend, sampler.microbatches(0))
        # warm-up: allocations, first-call overheads, compilation (--mixing-impl compiled, --compile-layers)
        for _ in range(2):
            timed(run, 1, record=False)
        return run

    def timed(run, steps, record=True):
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated()
        for _ in range(steps):
            t0 = time.perf_counter()
            train_step(run["backend"], run["sampler"].microbatches(run["step"]))
            if gpu:
                torch.cuda.synchronize()
            if record:
                run["times"].append(time.perf_counter() - t0)
            run["step"] += 1
        if gpu and record:
            run["peak"] = max(run["peak"], (torch.cuda.max_memory_allocated() - resident) / 2**20)

    def rounds(group):  # interleaved: drifts of the machine hit every model of the group alike
        for _ in range(args.rounds):
            for run in group:
                timed(run, args.steps)

    def medians(times):
        return [statistics.median(times[i * args.steps:(i + 1) * args.steps]) for i in range(args.rounds)]

    key = device_key(device)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (DEVICES[key][0] if key else None)
    bound_peak, bound_bw = DEVICES[key] if key else DEVICES[args.bound_device]
    from mega_depth.config import parse_args

    shape = parse_args(["--mock-data", "--hidden-size", str(d), "--num-layers", str(L), "--num-attention-heads",
                        str(heads), "--num-query-groups", str(groups), "--seq-length", str(args.seq_length),
                        "--vocab-size", "32000"] + layout).decoder_config()  # MoE flags: the active MLP widths
    fpt = flops_per_token(L, d, heads, groups, ffn, 32000, args.seq_length, shape.active_ffn_widths())
    fused = mixing_impl(layout) == "triton"
    base_io = training_io_units({"mechanism": "standard"}, L, d, heads, groups, fused)
    bytes_el = 2  # the bound models bf16 training on the GPU (the targets' setting), on any machine

    def result(name, run, base):
        t, tb = statistics.median(run["times"]), statistics.median(base["times"])
        extra = training_io_units(residual_settings(name, L), L, d, heads, groups, fused) - base_io
        bound = 1 + extra * d * bytes_el / bound_bw / (fpt / (args.bound_mfu * bound_peak))
        tps_base = base["tokens"] / tb
        return {
            "mechanism": name, "step_time_s": t, "tokens_per_s": run["tokens"] / t,
            "baseline_step_time_s": tb, "step_time_ratio": t / tb, "throughput_ratio": tb / t,
            "overhead_pct": 100 * (t / tb - 1),
            "overhead_pct_by_round": [100 * (m / b - 1) for m, b in zip(medians(run["times"]), medians(base["times"]))],
            "saved_bytes": run["saved_bytes"], "saved_bytes_ratio": run["saved_bytes"] / base["saved_bytes"],
            "step_peak_memory_mib": run["peak"] if gpu else None,
            "step_peak_memory_ratio": run["peak"] / base["peak"] if gpu and base["peak"] else None,
            "baseline_mfu": tps_base * fpt / peak if peak else None,
            "extra_io_units_of_d": extra, "analytic_bound_ratio": bound,
        }

    def write(results, complete):
        """The JSON so far: a time-boxed run (tools/device_check.sh) that is cut short keeps the finished pairs."""
        if args.out and torch.distributed.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump({"device": device, "world_size": world, "args": vars(args), "layout": layout,
                           "flops_per_token": fpt, "complete": complete, "results": results}, f, indent=1)

    results = []
    if args.resident == "all":
        runs = {name: build(name) for name in names}
        rounds(list(runs.values()))
        results = [result(name, runs[name], runs["standard"]) for name in names]
    else:
        # every pair times its own baseline, so the first pair's baseline gives the standard row: a pair of the
        # baseline alone would spend a GPU box's minute on nothing new
        for name in names[1:] or names:
            pair = []
            try:
                pair.append(build("standard"))
                base = pair[0]
                run = base if name == "standard" else build(name)
                pair.append(run)
                rounds([base] if run is base else [base, run])
                if not results:
                    results.append(result("standard", base, base))
                    if torch.distributed.get_rank() == 0:
                        print(f"measured standard: {1000 * results[0]['step_time_s']:.1f} ms a step", flush=True)
                if run is not base:
                    results.append(result(name, run, base))
                summary = f"{results[-1]['step_time_ratio']:.3f}x the baseline's step"
            except torch.OutOfMemoryError:
                if world > 1:  # the other ranks are inside the pair's collectives: stop them all
                    raise
                # one pair that does not fit must not cost the pairs after it (a time-boxed GPU run)
                held = torch.cuda.memory_allocated() / 2**20
                results.append({"mechanism": name, "error": f"out of memory ({held:.0f} MiB allocated)"})
                summary = results[-1]["error"]
            write(results, complete=False)
            for r in {id(r): r for r in pair}.values():
                r["backend"].close()
                r["backend"] = r["sampler"] = None
            pair = base = run = None
            if gpu:
                gc.collect()
                torch.cuda.empty_cache()
                summary += f"; {torch.cuda.memory_allocated() / 2**20:.0f} MiB still allocated after the pair"
            if torch.distributed.get_rank() == 0:
                print(f"measured {name}: {summary}", flush=True)
    if torch.distributed.get_rank() == 0:
        print(f"\nthroughput on {device}, world {world}: {L} layers, hidden {d}, heads {heads}/{groups}, seq "
              f"{args.seq_length}, mbs {args.micro_batch_size}; median of {args.rounds} x {args.steps} steps, "
              f"resident {args.resident}; FLOPs/token {fpt:.3g}")
        print(f"{'mechanism':<20}{'step s':>8}{'tokens/s':>10}{'vs base':>9}{'bound':>8}{'rounds':>16}"
              f"{'saved MiB':>11}{'x base':>8}" + (f"{'step MiB':>10}{'x base':>8}" if gpu else ""))
        for r in results:
            if "error" in r:
                print(f"{r['mechanism']:<20}{r['error']}")
                continue
            spread = f"{min(r['overhead_pct_by_round']):+.1f}..{max(r['overhead_pct_by_round']):+.1f}%"
            print(f"{r['mechanism']:<20}{r['step_time_s']:>8.3f}{r['tokens_per_s']:>10.0f}"
                  f"{r['step_time_ratio']:>8.3f}x{r['analytic_bound_ratio']:>7.3f}x{spread:>16}"
                  f"{r['saved_bytes'] / 2**20:>11.1f}{r['saved_bytes_ratio']:>7.2f}x"
                  + (f"{r['step_peak_memory_mib']:>10.0f}{r['step_peak_memory_ratio']:>7.2f}x" if gpu else ""))
        mfu = next((r["baseline_mfu"] for r in results if "error" not in r), None)
        mfu_text = "n/a (no GPU peak)" if peak is None else "n/a (no pair finished)" if mfu is None else \
            f"{100 * mfu:.1f} %"
        print(f"baseline MFU: {mfu_text}; bound: "
              f"{args.bound_device if not key else key} bandwidth at {args.bound_mfu:.0%} MFU")
    write(results, complete=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
