"""Training throughput of every mechanism against the standard residual, measured in the same run.

    python tools/bench_throughput.py [--hidden-size 512 --num-layers 12 --seq-length 256 --steps 4 --rounds 3]
        [--out bench.json] [--mechanisms standard,attnres-block,...]

All models are built once; then `--rounds` rounds each time `--steps` training steps of every mechanism in turn
(interleaved, so drifts of the machine hit all of them alike). Reports median step time, tokens/s and (on a GPU)
the step's peak memory above what was resident before it (activations and temporaries; every model stays
resident, so the plain peak would count them all) per mechanism, each also as a ratio to the baseline.
One process (the one GPU, or the CPU); run it under torchrun with the usual parallel flags (--tensor-model-parallel-size ...) for a multi-process layout.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mega_depth.catalogue import MECHANISMS, mechanism_flags, parse_mechanisms  # noqa: E402

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mechanism per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mechanisms", default=",".join(MECHANISMS))
    parser.add_argument("--out", default=None)
    args, layout = parser.parse_known_args(argv)

    import torch
    from megatron.core import parallel_state

    from mega_depth.config import parse_args
    from mega_depth.data.datasets import GlobalBatchSampler, MockTokenizer, build_datasets
    from mega_depth.training.loop import train_step
    from mega_depth.training.setup import init_distributed, setup

    world = init_distributed()
    gpu = torch.cuda.is_available()
    names = parse_mechanisms(args.mechanisms)
    if names[0] != "standard":
        names = ["standard"] + [n for n in names if n != "standard"]
    runs = {}
    for name in names:
        cfg = parse_args(["--mock-data", "--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers),
                          "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
                          "--vocab-size", "32000", "--micro-batch-size", str(args.micro_batch_size),
                          "--train-iters", str(args.steps * args.rounds + 2), "--lr-decay-style", "constant"]
                         + (["--bf16"] if gpu else []) + mechanism_flags(name, args.num_layers) + layout).validate(world)
        # Each mechanism keeps its own parallel groups alive: build them all up front, time them interleaved.
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        state = setup(cfg)
        dp = parallel_state.get_data_parallel_world_size()
        gbs = cfg.training.micro_batch_size * state.num_microbatches * dp
        data = build_datasets(cfg, MockTokenizer(32000), (cfg.training.train_iters * gbs, None, None))[0]
        sampler = GlobalBatchSampler(data, cfg.training.micro_batch_size, state.num_microbatches, dp,
                                     parallel_state.get_data_parallel_rank())
        for step in range(2):  # warm-up: allocations, first-call overheads, compilation (--compile-mixing)
            train_step(state, sampler.microbatches(step), step + 1)
        runs[name] = {"state": state, "sampler": sampler, "times": [], "tokens": gbs * cfg.model.seq_length,
                      "peak": 0.0, "step": 2}
    step = 1
    for _ in range(args.rounds):
        for name in names:
            r = runs[name]
            if gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                train_step(r["state"], r["sampler"].microbatches(r["step"]), r["step"] + 1)
                if gpu:
                    torch.cuda.synchronize()
                r["times"].append(time.perf_counter() - t0)
                r["step"] += 1
            if gpu:
                r["peak"] = max(r["peak"], (torch.cuda.max_memory_allocated() - resident) / 2**20)
    base = statistics.median(runs["standard"]["times"])
    base_peak = runs["standard"]["peak"]

    def round_medians(times):
        return [statistics.median(times[i * args.steps:(i + 1) * args.steps]) for i in range(args.rounds)]

    base_rounds = round_medians(runs["standard"]["times"])
    results = []
    for name in names:
        r = runs[name]
        t = statistics.median(r["times"])
        # Noise estimate from the same run: the overhead measured within each round separately.
        per_round = [100 * (m / b - 1) for m, b in zip(round_medians(r["times"]), base_rounds)]
        results.append({
            "mechanism": name, "step_time_s": t, "tokens_per_s": r["tokens"] / t,
            "step_time_ratio": t / base, "throughput_ratio": base / t, "overhead_pct": 100 * (t / base - 1),
            "overhead_pct_by_round": per_round,
            "step_peak_memory_mib": r["peak"] if gpu else None,
            "step_peak_memory_ratio": (r["peak"] / base_peak) if gpu and base_peak else None,
        })
    device = torch.cuda.get_device_name() if gpu else f"CPU ({os.cpu_count()} cores)"
    if torch.distributed.get_rank() == 0:
        print(f"\nthroughput on {device}, world {world}: {args.num_layers} layers, hidden {args.hidden_size}, "
              f"seq {args.seq_length}, mbs {args.micro_batch_size}; median of {args.rounds} x {args.steps} steps")
        print(f"{'mechanism':<17}{'step s':>9}{'tokens/s':>11}{'vs baseline':>13}{'overhead':>10}"
              f"{'rounds min..max':>18}" + (f"{'step MiB':>10}{'vs base':>9}" if gpu else ""))
        for r in results:
            spread = f"{min(r['overhead_pct_by_round']):.1f}..{max(r['overhead_pct_by_round']):.1f}%"
            print(f"{r['mechanism']:<17}{r['step_time_s']:>9.3f}{r['tokens_per_s']:>11.0f}"
                  f"{r['throughput_ratio']:>12.3f}x{r['overhead_pct']:>9.1f}%{spread:>18}"
                  + (f"{r['step_peak_memory_mib']:>10.0f}{r['step_peak_memory_ratio']:>8.2f}x" if gpu else ""))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": device, "world_size": world, "args": vars(args), "layout": layout,
                           "results": results}, f, indent=1)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
