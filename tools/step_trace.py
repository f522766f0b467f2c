"""What one training step asks of a GPU, per setting, traced on meta tensors at the real shape (no GPU, seconds).

    python tools/step_trace.py                                   # the 1B class, every catalogue setting
    python tools/step_trace.py --mechanisms standard,dca-2 --hidden-size 4096 ... [--out trace.json]

One micro-batch forward and backward of the real Megatron-core model (mega_depth/megatron/step_trace.py), bf16,
`--mixing-impl triton` as on a GPU: aten calls, the memory-bound aten traffic outside the mixing's Triton kernels
(and its difference from the baseline's), the GEMMs (count, batched ones, TFLOPs), attention calls, Triton
launches, custom-op calls and backward passes (the step's own plus one per recomputed region), as the markdown
table docs/benchmarks.md keeps.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ONE_B = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--num-query-groups", "8",
         "--seq-length", "2048", "--micro-batch-size", "4", "--vocab-size", "32000"]


def trace_settings(mechanisms, shape, extra=()):
    """{setting: (StepTrace, summary)} for each setting, the baseline ("standard") first."""
    from mega_depth.catalogue import mechanism_flags
    from mega_depth.config import parse_args
    from mega_depth.megatron.step_trace import summary, trace_step
    from mega_depth.training.backends.startup import start_megatron

    layers = int(shape[shape.index("--num-layers") + 1])
    out = {}
    for name in ["standard"] + [m for m in mechanisms if m != "standard"]:
        cfg = parse_args(["--mock-data", "--bf16", "--mixing-impl", "triton"] + list(shape) + list(extra)
                         + mechanism_flags(name, layers)).validate(1)
        start_megatron(cfg)
        trace = trace_step(cfg)
        unit = cfg.model.seq_length * cfg.training.micro_batch_size * cfg.model.hidden_size * 2  # [T, d] in bf16
        model_units = cfg.decoder_config().mechanism().kernel_io_units(recompute=cfg.model.mixing_recompute)
        model_gb = model_units * unit / 1e9
        out[name] = (trace, dict(summary(trace), kernel_model_gb=model_gb))
    return out


def rows(traced):
    base = traced["standard"][1]
    for name, (_, s) in traced.items():
        yield name, dict(s, over_baseline_gb=s["memory_bound_gb"] - base["memory_bound_gb"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mechanisms", default=None, help="catalogue settings, comma-separated (default: all)")
    parser.add_argument("--out", default=None, help="write the summaries as JSON")
    args, shape = parser.parse_known_args(argv)
    from mega_depth.catalogue import SETTINGS
    from mega_depth.quiet import quiet_known_warnings

    quiet_known_warnings()
    traced = trace_settings(args.mechanisms.split(",") if args.mechanisms else SETTINGS, shape or ONE_B)
    table = dict(rows(traced))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": shape or ONE_B, "settings": table}, f, indent=1)
    print("| setting | aten calls | memory-bound aten GB | over the baseline | mixing kernels GB (model) | "
          "GEMMs (batched) | GEMM TFLOPs | attention | Triton launches | custom ops | backward passes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, s in table.items():
        print(f"| {name} | {s['aten_calls']:,} | {s['memory_bound_gb']:.0f} | {s['over_baseline_gb']:+.0f} | "
              f"{s['mixing_kernel_gb']:.0f} ({s['kernel_model_gb']:.0f}) | "
              f"{s['gemm_calls']} ({s['bmm_calls']}) | {s['gemm_tflops']:.2f} | {s['attention_calls']} | "
              f"{s['triton_launches']} | {s['custom_op_calls']} | {s['backward_passes']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
