"""The host's time per training step, per setting, against the baseline in the same run (no GPU, seconds).

    python tools/bench_host.py                                     # the 1B class's 24 layers, every setting
    python tools/bench_host.py --mechanisms standard,mhc --num-layers 12 ... [--repeats 5] [--out host.json]

A GPU step is host-bound when Python, autograd and the dispatcher take longer than its kernels: the device idles
between launches. This measures that host work alone: the process CPU time of one micro-batch forward and backward
of the real Megatron-core model at toy widths on the CPU (mega_depth/megatron/step_trace.HostTimer: the widths
barely change the host's work, the layer count and the mechanism do), with the mixing's and Liger-Kernel's Triton
launches recorded instead of run, the median of --repeats after a warm-up. Every model is built once; in each round
every setting is timed right after the baseline, and its ratio is taken to that baseline measurement, so that a
machine's drift (a shared CPU's speed moves by 5-10 % over minutes) reaches both sides of a ratio alike. The ratio
reported is the median over rounds; it is the speed issue's host target. Beside it, the calls one pass makes from
Python (functions and C functions, sys.setprofile): the host's work counted without the machine's noise. The launches
counted by tools/step_trace.py add the driver's few microseconds each on a GPU. The GEMMs are left unrun (a GPU's
work; a CPU without bf16 matrix units takes a millisecond for each of the toy widths' GEMMs).
"""

import argparse
import gc
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The 1B class's depth (what the host's work grows with: layers, and so sources, blocks, candidates) at toy widths
# (what it does not grow with), so that the CPU's arithmetic stays small beside the host's work
TOY_1B = ["--num-layers", "24", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
          "--seq-length", "64", "--micro-batch-size", "1", "--vocab-size", "256"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mechanisms", default=None, help="catalogue settings, comma-separated (default: all)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forward+backward passes per setting and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all settings, each after a baseline")
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args, shape = parser.parse_known_args(argv)
    if args.repeats < 1 or args.rounds < 1:
        parser.error(f"--repeats and --rounds must be at least 1 (got {args.repeats}, {args.rounds})")
    import torch

    from mega_depth.catalogue import SETTINGS, mechanism_flags, parse_mechanisms
    from mega_depth.config import parse_args
    from mega_depth.megatron.step_trace import HostTimer
    from mega_depth.quiet import quiet_known_warnings
    from mega_depth.training.backends.startup import start_megatron

    quiet_known_warnings()
    torch.set_num_threads(1)  # the host's work is one thread's; intra-op threads at toy widths only add noise
    shape = shape or TOY_1B
    if "--num-layers" not in shape:
        parser.error("give the model's shape with --num-layers (and the other sizes), or none for the 1B depth")
    layers = int(shape[shape.index("--num-layers") + 1])
    wanted = parse_mechanisms(args.mechanisms) if args.mechanisms else list(SETTINGS)
    names = ["standard"] + [m for m in wanted if m != "standard"]
    timers = {}
    for name in names:  # the same parallel state for every setting: one process, no model parallelism
        cfg = parse_args(["--mock-data", "--bf16", "--mixing-impl", "triton"] + list(shape)
                         + mechanism_flags(name, layers)).validate(1)
        start_megatron(cfg)
        timers[name] = HostTimer(cfg)
    # Every model and module built so far is kept for the whole run: out of the collector's reach, so that a full
    # collection (which walks every tracked object, the 10 models' half a million of them) cannot land in a timed pass
    gc.collect()
    gc.freeze()
    calls = {name: timers[name].python_calls() for name in names}  # the same every run: the noise-free column
    times = {name: [] for name in names}
    ratios = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            base = timers["standard"](args.repeats)
            own = base if name == "standard" else timers[name](args.repeats)
            times["standard"] += base
            if name != "standard":
                times[name] += own
            ratios[name].append(statistics.median(own) / statistics.median(base))
            gc.collect()  # the step's graph goes before the next is timed (a cyclic GC pass costs)
    results = {name: {"host_ms": 1000 * statistics.median(times[name]),
                      "host_ratio": statistics.median(ratios[name]), "round_ratios": ratios[name],
                      "samples_ms": [1000 * x for x in times[name]], "python_calls": calls[name],
                      "python_calls_ratio": calls[name] / calls["standard"]} for name in names}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": shape, "repeats": args.repeats, "rounds": args.rounds, "settings": results}, f,
                      indent=1)
    print("| setting | host ms (forward + backward) | ratio to the baseline | Python calls | ratio to the baseline |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        print(f"| {name} | {r['host_ms']:.1f} | {r['host_ratio']:.2f}x | {r['python_calls']:,} | "
              f"{r['python_calls_ratio']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
