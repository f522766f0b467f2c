"""Resources of every Triton kernel the shipped configs launch, compiled ahead of time for real GPU targets.

    python tools/kernel_resources.py [--configs 125m,1b,7b] [--targets 80,90,100] [--dtypes bf16,fp32]
        (a dtype may name its own targets: --dtypes bf16,fp32:90 compiles fp32 for sm_90 alone)
        [--out docs/kernel_resources.json] [--markdown]

For each config launch/configs/<size>-<mechanism>.yaml the mechanism's mixing runs one training step on meta
tensors at the config's sizes and TP/SP split, its Triton launches are recorded (mega_depth/kernels/aot.py), and
each distinct specialisation is compiled for each target (sm_80 A100, sm_90 H100/H200, sm_100 B200) and dtype. No
GPU is needed. Per kernel: registers, stack, shared memory, spill stores / loads (ptxas -v) and occupancy (resident
warps per SM) and the width of its global loads (PTX: a bf16 row read 2 bytes a load is a failure, 16 is what
bandwidth wants), and the fewest programs of any of its launches that moves 32 MB or more (fewer than the target's
SMs leave SMs idle while it streams: tests/unit/test_kernels_aot.py holds the 1B and 7B steps to one an SM). Exits
1 on a compile error, a spill or a narrow load. --markdown prints the table docs/benchmarks.md keeps.
"""

import argparse
import glob
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
BIG_LAUNCH_BYTES = 32 * 10 ** 6  # a launch that moves this much is a stream a whole GPU should take part in


def config_paths(sizes):
    return sorted(p for size in sizes for p in glob.glob(os.path.join(ROOT, "launch", "configs", f"{size}-*.yaml")))


def load_config(path):
    from mega_depth.config import parse_args

    cfg = parse_args(["--config", path, "--mock-data"])
    p = cfg.parallel  # the smallest world the layout fits: TP x CP per stage, or the experts' EP x expert-TP
    per_stage = max(p.tensor_model_parallel_size * p.context_parallel_size,
                    p.expert_model_parallel_size * (p.expert_tensor_parallel_size or p.tensor_model_parallel_size))
    return cfg.validate(per_stage * p.pipeline_model_parallel_size)


def survey(sizes, targets, dtypes, log=print, workers=None):
    """[{configs, dtype, target, kernel, registers, ..., error}]: every distinct launch of the configs (a kernel
    specialisation that several configs launch is compiled once per target and dtype). Each (dtype, target) is
    one job; the jobs run in `workers` processes (default: one per core), since compiling is CPU-bound."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = []
    for spec in dtypes:  # "fp32" (every target) or "fp32:90+100" (those targets)
        dtype, _, own = spec.partition(":")
        jobs += [(sizes, dtype, target) for target in ([int(t) for t in own.split("+")] if own else targets)]
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    if workers == 1:
        done = map(_survey_one, jobs)
    else:
        pool = ProcessPoolExecutor(workers)
        done = pool.map(_survey_one, jobs)
    rows = []
    for job_rows, line in done:
        rows += job_rows
        log(line)
    if workers > 1:
        pool.shutdown()
    return rows


def _survey_one(job):
    """(rows, a log line) of one (sizes, dtype, target) job."""
    import torch

    from mega_depth.kernels import aot, tuning
    from mega_depth.kernels.common import launch_bytes

    sizes, dtype, target = job
    start, seen, fewest = time.time(), {}, {}
    for path in config_paths(sizes):
        name, cfg = os.path.basename(path)[:-5], load_config(path)
        for launch in aot.config_launches(cfg, getattr(torch, DTYPES[dtype]), aot.TARGETS[target][0]):
            key = aot.specialisation(launch)
            seen.setdefault(key, (launch, set()))[1].add(name)
            if launch_bytes(launch) >= BIG_LAUNCH_BYTES:  # the fewest programs of a launch with much to move
                fewest[key] = min(fewest.get(key, math.inf), math.prod(launch.grid))
    rows = []
    for key, (launch, names) in seen.items():
        row = {"configs": sorted(names), "dtype": dtype, "target": f"sm_{target}",
               "kernel": aot.describe(aot.tuned(launch, target)),  # the warps it runs with there
               # those warps measured fastest on a GPU of the target (kernels/tuned.json), not the launcher's guess
               "tuned": tuning.measured(launch.kernel, launch.args, launch.constexprs, f"sm_{target}"),
               "fewest_programs_of_a_big_launch": fewest.get(key)}
        if row["tuned"]:  # the table entry it takes (tests/unit/test_kernels_aot.py: no entry goes unmatched)
            row["table_key"] = tuning.key(launch.kernel, launch.args, launch.constexprs)
        try:
            row.update(aot.resources(aot.compile_launch(launch, target), target))
        except Exception as exc:  # a compile error is a result here, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        rows.append(row)
    return rows, f"{dtype} sm_{target}: {len(seen)} distinct kernels in {time.time() - start:.1f} s"


def failures(rows):
    """Rows with a compile error, a spill, or a global load of 2 bytes or less a thread (a bf16 row read one value
    at a time: latency-bound where it should move 16 bytes a load)."""
    return [r for r in rows if r.get("error") or r.get("spill_stores") or r.get("local") or r.get("narrow_loads")]


def markdown(rows):
    """One line per kernel: over all its specialisations (configs, shapes), per target (bf16) and per other dtype
    and target (fp32 sm_90) the most registers and the lowest occupancy; the most shared memory and stack; the
    spills and the narrow loads (all 0 when the check passes); over the bf16 rows, the narrowest of the kernels'
    widest loads (bytes a thread) and the smallest load wave (KiB an SM asks for with one such load a thread); the
    most barriers in a bf16 sm_90 specialisation's PTX (the points where a program's warps wait for one another);
    the most global atomic instructions (a reduction whose order varies from run to run)."""
    kernels = {}
    for r in rows:
        k = kernels.setdefault(r["kernel"].split("(")[0], {"targets": {}, "shared": 0, "stack": 0, "spills": 0,
                                                           "n": 0, "errors": 0, "narrow": 0, "widest": None,
                                                           "wave": None, "atomics": 0, "barriers": None})
        if r.get("error"):
            k["errors"] += 1
            continue
        column = r["target"] if r["dtype"] == "bf16" else f"{r['dtype']} {r['target']}"
        t = k["targets"].setdefault(column, [0, 100])
        t[0], t[1] = max(t[0], r["registers"]), min(t[1], r["occupancy"])
        k["shared"], k["stack"] = max(k["shared"], r["shared"]), max(k["stack"], r["stack"])
        k["spills"] += r["spill_stores"] + r["local"]
        k["narrow"] += r.get("narrow_loads", 0)
        k["atomics"] = max(k["atomics"], r.get("atomics", 0))
        if r["dtype"] == "bf16" and r["target"] == "sm_90" and "barriers" in r:
            k["barriers"] = max(k["barriers"] or 0, r["barriers"])
        if r["dtype"] == "bf16" and "widest_load" in r:
            k["widest"] = min(k["widest"] or r["widest_load"], r["widest_load"])
            k["wave"] = min(k["wave"] or r["load_wave"], r["load_wave"])
        k["n"] += 1
    targets = sorted({r["target"] if r["dtype"] == "bf16" else f"{r['dtype']} {r['target']}" for r in rows},
                     key=lambda t: (" " in t, t.split()[0] if " " in t else "", int(t.split()[-1][3:])))
    lines = ["| kernel | compiled | " + " | ".join(f"{t}: regs / occupancy" for t in targets) +
             " | shared B | stack B | spills B | narrow loads | bf16 load B | bf16 load wave KiB/SM"
             " | bf16 sm_90 barriers | atomics | errors |",
             "|---|---:|" + "---:|" * len(targets) + "---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, k in sorted(kernels.items()):
        cells = [f"{k['targets'][t][0]} / {k['targets'][t][1]} %" if t in k["targets"] else "" for t in targets]
        wave = "" if k["wave"] is None else f"{k['wave'] / 1024:.0f}"
        lines.append(f"| `{name}` | {k['n']} | " + " | ".join(cells) + f" | {k['shared']} | {k['stack']} | "
                     f"{k['spills']} | {k['narrow']} | {k['widest'] or ''} | {wave} | "
                     f"{'' if k['barriers'] is None else k['barriers']} | {k['atomics']} | {k['errors']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--configs", default="125m,1b,7b", help="config sizes (launch/configs/<size>-*.yaml)")
    parser.add_argument("--targets", default="80,90,100", help="compute capabilities")
    parser.add_argument("--dtypes", default="bf16,fp32", help="dtypes, each for every target or for its own "
                                                               "(fp32:90+100)")
    parser.add_argument("--out", default=None, help="write every row as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the markdown table")
    args = parser.parse_args(argv)
    rows = survey(args.configs.split(","), [int(t) for t in args.targets.split(",")], args.dtypes.split(","))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        print(markdown(rows))
    bad = failures(rows)
    for r in bad:
        why = r.get("error") or (f"{r['narrow_loads']} global loads of 2 bytes or less" if r.get("narrow_loads")
                                 else f"{r['spill_stores']} B spill stores, {r['local']} B local")
        print(f"FAIL {','.join(r['configs'])} {r['dtype']} {r['target']} {r['kernel']}: {why}")
    print(f"{len(rows)} compiled kernels, {len(bad)} with a compile error, a spill or a narrow load")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
