"""Where one training step's time goes: torch.profiler over a step of the baseline and of each mechanism given.

    python tools/profile_step.py [--mechanisms attnres-block] [--hidden-size 2048 --num-layers 24 ...]
        [--out-dir docs/profile]

Per setting (the baseline first), after two warm-up steps, one step is profiled and reported:
- the step's wall time, the GPU's busy time (the union of its kernels' intervals) and its idle time, with the
  longest idle gaps (a gap is where the GPU waited for the host: a sync, launch overhead, Python);
- the top kernels by GPU time, with their share of the busy time, and the mixing's own kernels' share
  (mega_depth's Triton kernels and custom ops).
Writes <out-dir>/profile.json and profile.md (a table per setting). On a CPU it profiles CPU operators only (a dry
run of the tool: no idle gaps to speak of).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mega_depth.catalogue import mechanism_flags, parse_mechanisms  # noqa: E402



def mixing_kernel_names():
    """The Triton kernels of mega_depth/kernels by name, each with the modules that define one of that name (a GPU
    trace names a kernel by its function alone: several ops have a `_fwd_kernel`)."""
    import importlib

    names = {}
    for op in ("attnres_mix", "attnres_block", "grn", "depth_attention", "streams", "sinkhorn", "mhc_maps",
               "mhc_projection", "common"):
        module = importlib.import_module(f"mega_depth.kernels.{op}")
        for n, v in vars(module).items():
            if n.endswith("_kernel") and hasattr(v, "fn"):
                names.setdefault(n, []).append(op)
    return names


def is_mixing(name: str, kernels) -> bool:
    """A mixing kernel on a GPU (exact name), or the mixing's custom op on a CPU."""
    return name in kernels or name.startswith("mega_depth::")


def intervals(events, gpu: bool):
    """[(start_us, end_us, name)] of the device's kernels (GPU) or of the top-level CPU operators (CPU). On a GPU the
    ranges of record_function (the mixing's custom ops, the optimizer step) are mirrored onto the device's timeline
    as user annotations: they span kernels (and the gaps between them), so they are left out."""
    out = []
    for e in events:
        on_device = getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)
        if gpu and on_device and e.time_range.elapsed_us() > 0 and not getattr(e, "is_user_annotation", False):
            out.append((e.time_range.start, e.time_range.end, e.name))
        elif not gpu and not on_device and e.cpu_parent is None:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def busy_and_gaps(spans, top: int = 5):
    """(busy_us, [(gap_us, after_kernel, before_kernel)] longest first) over sorted intervals."""
    busy, gaps, end, last = 0.0, [], None, ""
    for start, stop, name in spans:
        if end is None or start > end:
            if end is not None:
                gaps.append((start - end, last, name))
            busy += stop - start
            end, last = stop, name
        elif stop > end:
            busy += stop - end
            end, last = stop, name
    return busy, sorted(gaps, reverse=True)[:top]


def profile(backend, sampler, step: int, gpu: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from harness import train_step

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    if gpu:
        torch.cuda.synchronize()
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        train_step(backend, sampler.microbatches(step))
        if gpu:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    spans = intervals(prof.events(), gpu)
    busy, gaps = busy_and_gaps(spans)
    span_us = (spans[-1][1] - spans[0][0]) if spans else 0.0
    totals, calls = {}, {}
    for start, stop, name in spans:
        totals[name] = totals.get(name, 0.0) + stop - start
        calls[name] = calls.get(name, 0) + 1
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:15]
    kernels = mixing_kernel_names()
    mixing = sum(t for name, t in totals.items() if is_mixing(name, kernels))
    return {"wall_ms": wall_us / 1e3, "device_span_ms": span_us / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": (span_us - busy) / 1e3, "idle_pct": 100 * (span_us - busy) / span_us if span_us else None,
            "mixing_kernels_ms": mixing / 1e3, "mixing_pct_of_busy": 100 * mixing / busy if busy else None,
            # each mixing kernel's device time in the step and its launches: the kernels' cost where it counts,
            # free of the host's launch time that a timing of one call around a sync includes
            "mixing_kernels": [{"name": n, "ops": kernels.get(n, []), "ms": t / 1e3, "calls": calls[n],
                                "us_per_call": t / calls[n]}
                               for n, t in sorted(totals.items(), key=lambda kv: -kv[1]) if is_mixing(n, kernels)],
            "longest_gaps": [{"us": g, "after": a[:80], "before": b[:80]} for g, a, b in gaps],
            "top_kernels": [{"name": n[:120], "ms": t / 1e3, "pct_of_busy": 100 * t / busy if busy else None}
                            for n, t in top],
            # every kernel (GPU) or top-level operator (CPU), so that a setting's extra device time can be put
            # down kernel by kernel against the baseline's (markdown: "Over the baseline")
            "every_kernel": {n[:120]: {"ms": t / 1e3, "calls": calls[n]}
                             for n, t in sorted(totals.items(), key=lambda kv: -kv[1])}}


def over_baseline(own: dict, base: dict, top: int = 12) -> list:
    """[(name, ms over the baseline's, own ms, own calls)] of the kernels whose device time in the step differs most
    from the baseline's (new kernels, and the baseline's kernels run more or less often)."""
    own_k, base_k = own.get("every_kernel", {}), base.get("every_kernel", {})
    names = set(own_k) | set(base_k)
    rows = [(n, own_k.get(n, {}).get("ms", 0.0) - base_k.get(n, {}).get("ms", 0.0), own_k.get(n, {}).get("ms", 0.0),
             own_k.get(n, {}).get("calls", 0)) for n in names]
    return sorted(rows, key=lambda r: -abs(r[1]))[:top]


def markdown(results: dict, device: str, shape: str) -> str:
    lines = [f"Profile of one training step on {device} ({shape}).", ""]
    for name, r in results.items():
        lines += [f"**{name}**: step {r['wall_ms']:.1f} ms wall; device busy {r['busy_ms']:.1f} ms, idle "
                  f"{r['idle_ms']:.1f} ms ({r['idle_pct'] or 0:.1f} % of its span); mixing kernels "
                  f"{r['mixing_kernels_ms']:.2f} ms ({r['mixing_pct_of_busy'] or 0:.1f} % of busy).", "",
                  "| kernel | ms | % of busy |", "|---|---:|---:|"]
        lines += [f"| `{k['name']}` | {k['ms']:.2f} | {k['pct_of_busy'] or 0:.1f} |" for k in r["top_kernels"]]
        if r.get("mixing_kernels"):
            lines += ["", "| mixing kernel | defined in | ms | launches | us a launch |", "|---|---|---:|---:|---:|"]
            lines += [f"| `{k['name']}` | {', '.join(k['ops'])} | {k['ms']:.2f} | {k['calls']} | "
                      f"{k['us_per_call']:.1f} |" for k in r["mixing_kernels"]]
            layers = r.get("layers") or 1
            lines += ["", f"A layer's share: {r['mixing_kernels_ms'] / layers:.2f} ms of mixing kernels in "
                          f"{r['busy_ms'] / layers:.2f} ms of device time a layer ({layers} layers)."]
        if name != "standard" and "standard" in results:
            extra = r["busy_ms"] - results["standard"]["busy_ms"]
            lines += ["", f"Over the baseline: {extra:+.2f} ms of device busy time. The kernels that differ most:", "",
                      "| kernel | ms over the baseline | ms | launches |", "|---|---:|---:|---:|"]
            lines += [f"| `{n[:100]}` | {d:+.2f} | {t:.2f} | {c} |"
                      for n, d, t, c in over_baseline(r, results["standard"])]
        gaps = ", ".join(f"{g['us']:.0f} us after `{g['after'][:40]}`" for g in r["longest_gaps"][:3])
        lines += ["", f"Longest idle gaps: {gaps or 'none'}.", ""]
    return "\n".join(lines)


def save(results: dict, args) -> None:
    """profile.json and profile.md in args.out_dir, of the settings profiled so far."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    shape = f"{args.num_layers} layers, d={args.hidden_size}, heads {args.num_attention_heads}/" \
            f"{args.num_query_groups}, seq {args.seq_length}, mbs {args.micro_batch_size}"
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "profile.json"), "w") as f:
        json.dump({"device": device, "shape": shape, "results": results}, f, indent=1)
    with open(os.path.join(args.out_dir, "profile.md"), "w") as f:
        f.write(markdown(results, device, shape) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--mechanisms", default="attnres-block")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--num-query-groups", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--out-dir", default="runs/profile")
    args, extra = parser.parse_known_args(argv)

    import torch

    from harness import megatron_run, start, train_step

    start()
    gpu = torch.cuda.is_available()
    L, d = args.num_layers, args.hidden_size
    results = {}
    for name in ["standard"] + [m for m in parse_mechanisms(args.mechanisms) if m != "standard"]:
        flags = ["--mock-data", "--hidden-size", str(d), "--num-layers", str(L), "--num-attention-heads",
                 str(args.num_attention_heads), "--num-query-groups", str(args.num_query_groups), "--seq-length",
                 str(args.seq_length), "--vocab-size", "32000", "--micro-batch-size", str(args.micro_batch_size),
                 "--train-iters", "8", "--lr-decay-style", "constant"] + (["--bf16"] if gpu else []) \
            + mechanism_flags(name, L) + extra
        backend, sampler = megatron_run(flags, 256)
        for step in range(2):  # warm-up: allocations, compilation
            train_step(backend, sampler.microbatches(step))
        results[name] = dict(profile(backend, sampler, 2, gpu), layers=L)
        backend.close()
        if gpu:
            torch.cuda.empty_cache()
        r = results[name]
        print(f"{name}: step {r['wall_ms']:.1f} ms, device idle {r['idle_ms']:.1f} ms, mixing kernels "
              f"{r['mixing_kernels_ms']:.2f} ms", flush=True)
        save(results, args)  # after every setting: a run cut short by its time box keeps what it finished
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
