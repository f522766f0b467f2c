"""Smoke test: a few training steps of every mechanism on one GPU (or the CPU when there is none).

    python tools/smoke_test.py [--steps 8] [--hidden-size 128] [--num-layers 4] [--out smoke.json]

Checks that the loss falls and that nothing is NaN, then prints mechanism / first and last loss / tokens per
second / peak memory. Exit status 1 if any mechanism fails a check.
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    import torch

    from harness import megatron_run, start, train_step
    from mega_depth.catalogue import SETTINGS, mechanism_flags

    start()
    gpu = torch.cuda.is_available()
    results = []
    for name in SETTINGS:
        flags = mechanism_flags(name, args.num_layers)
        backend, sampler = megatron_run(
            ["--mock-data", "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
             "--num-attention-heads", "4", "--seq-length", str(args.seq_length), "--vocab-size", "512",
             "--micro-batch-size", str(args.micro_batch_size), "--train-iters", str(args.steps), "--lr", "3e-3",
             "--lr-decay-style", "constant"] + (["--bf16"] if gpu else []) + flags,
            args.steps * args.micro_batch_size)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        losses, times = [], []
        for step in range(args.steps):
            t0 = time.perf_counter()
            losses.append(train_step(backend, sampler.microbatches(step)))
            if gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        steady = times[1:] or times
        if gpu:
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            import psutil

            peak = psutil.Process().memory_info().rss / 2**20
        ok = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        results.append({"mechanism": name, "first_loss": losses[0], "last_loss": losses[-1],
                        "tokens_per_s": args.micro_batch_size * args.seq_length / (sum(steady) / len(steady)),
                        "peak_memory_mib": peak, "ok": ok})
        backend.close()
    device = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"\nsmoke test on {device}: {args.steps} steps, {args.num_layers} layers, hidden {args.hidden_size}")
    print(f"{'mechanism':<17}{'first loss':>11}{'last loss':>11}{'tokens/s':>11}{'peak MiB':>10}  check")
    for r in results:
        print(f"{r['mechanism']:<17}{r['first_loss']:>11.4f}{r['last_loss']:>11.4f}{r['tokens_per_s']:>11.0f}"
              f"{r['peak_memory_mib']:>10.0f}  {'ok' if r['ok'] else 'FAILED (NaN or loss did not fall)'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "results": results}, f, indent=1)
    torch.distributed.destroy_process_group()
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
