"""Pipeline traffic of every mechanism: bytes per hop per micro-batch, measured from the real p2p tensors, for a
grid of pipeline stages P and virtual stages V, with and without cross-stage caching, against the state each
mechanism carries across depth (docs/mechanisms.md).

    python tools/bench_comm.py [--grid 2x1,2x2,4x1,4x2] [--num-layers 8] [--hidden-size 64] [--out comm.json]
        [trainer flags, e.g. --num-experts 4: the same grid on MoE layers, whose hops must carry the same bytes]

For each P x V it launches P processes (torchrun, gloo on CPU or NCCL on GPUs) that run one training step of every
mechanism and read mega_depth's hop counter. The expected widths come from the formulas below, written from the
math independently of the mechanisms' own payload layouts (a new mechanism adds its formula to EXPECTED; without
one its widths are reported unchecked). Also reported: the cross-layer state a stage holds at its end (the
activation memory of the depth state, in units of d per token and in bytes per micro-batch).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mega_depth.catalogue import SETTINGS, mechanism_flags, parse_mechanisms, residual_settings  # noqa: E402
from mega_depth.training.distributed import free_port  # noqa: E402



# ---------------------------------------------------------------------------------------------------------------
# The carried depth state, in units of d per token: entries that exist before layer `lam` (0-based), by name
# ---------------------------------------------------------------------------------------------------------------

def attnres_entries(lam, num_layers, num_blocks):
    """Completed block sums b_0..b_{n-1} (immutable) and the partial sum of the current block (mutable)."""
    L, i = 2 * num_layers, 2 * lam + 1
    n_blocks = num_blocks or L
    size = L // n_blocks
    block = lambda j: min((j - 1) // size, n_blocks - 1) + 1  # noqa: E731
    if i > L:
        return {f"b{n}": (1, True) for n in range(n_blocks + 1)}
    completed = block(i) - 1
    out = {f"b{n}": (1, True) for n in range(completed + 1)}
    if i > 1 and block(i - 1) == block(i):
        out["partial"] = (1, False)
    return out


def dca_entries(lam, last_k):
    """x and the block outputs f_1..f_lam (immutable); k-DCA keeps x, the sum of the older ones, the last k."""
    if last_k is None or lam <= last_k:
        return {"x": (1, True), **{f"f{j}": (1, True) for j in range(1, lam + 1)}}
    return {"x": (1, True), "sum": (1, False), **{f"f{j}": (1, True) for j in range(lam - last_k + 1, lam + 1)}}


def depth_entries(lam, num_layers, stride, window, kv_units, v_units):
    """The hidden state plus raw key and mixed value of every earlier layer a later layer still mixes."""
    def candidates(layer):
        return {j for j in range(layer) if (stride and j % stride == 0) or j >= layer - window}

    out = {"hidden": (1, False)}
    for j in range(lam):
        if any(j in candidates(later) for later in range(lam, num_layers)):
            out[f"k{j}"], out[f"v{j}"] = (kv_units, True), (v_units, True)
    return out


def stream_entries(n):
    """HC / mHC: the n streams, rewritten by every sublayer."""
    return {"streams": (n, False)}


def denseformer_entries(units_done, num_units, k, p):
    """DenseFormer: Y_i, plus every stored X_j a later DWA reads ({j <= i: j mod k in C_i}); Y_i travels on its own
    only when a DWA follows unit i or X_i is not in the set."""
    later_classes = {u % k for u in range(units_done + 1, num_units + 1) if u % p == 0}
    stored = [j for j in range(units_done + 1) if j % k in later_classes]
    out = {f"x{j}": (1, True) for j in stored}
    dwa_here = units_done >= 1 and units_done % p == 0
    if dwa_here or units_done not in stored:
        out["y"] = (1, False)
    return out


# The formulas by mechanism: (lam, the setting's options, the run's shape) -> entries
EXPECTED = {
    "standard": lambda lam, o, shape: {"hidden": (1, False)},
    "attnres": lambda lam, o, shape: attnres_entries(lam, shape["num_layers"], o["attnres_num_blocks"]),
    "dca": lambda lam, o, shape: dca_entries(lam, o["dca_last_k"]),
    "hc": lambda lam, o, shape: stream_entries(o["hc_expansion"]),
    "mhc": lambda lam, o, shape: stream_entries(o["hc_expansion"]),
    "denseformer": lambda lam, o, shape: denseformer_entries(lam, shape["num_layers"], o["denseformer_dilation"],
                                                             o["denseformer_period"]),
    "depth-attention": lambda lam, o, shape: depth_entries(lam, shape["num_layers"], o["depth_attn_stride"],
                                                           o["depth_attn_window"], shape["kv_units"],
                                                           shape["v_units"]),
}


def expected_widths(mech, num_layers, num_blocks, pp, vpp, cache, kv_units, v_units):
    """{receiving stage: width in units of d} for every hop, or None for a mechanism without a formula."""
    per_stage = num_layers // (pp * vpp)
    from dataclasses import asdict

    from mega_depth.model.config import residual_config

    options = asdict(residual_config(residual_settings(mech, num_layers, **({"attnres_num_blocks": num_blocks}
                                                                            if mech == "attnres-block" else {}))))
    formula = EXPECTED.get(options["mechanism"])
    if formula is None:
        return None
    shape = {"num_layers": num_layers, "kv_units": kv_units, "v_units": v_units}

    def entries(lam):
        return formula(lam, options, shape)

    out = {}
    for stage in range(1, pp * vpp):
        now = entries(stage * per_stage)
        held = set()
        if cache and vpp > 1 and stage >= pp:  # what this rank kept from its previous chunk of the micro-batch
            held = {n for n, (_, imm) in entries((stage - pp + 1) * per_stage).items() if imm}
        out[stage] = sum(w for n, (w, imm) in now.items() if not (imm and n in held))
    return out


# ---------------------------------------------------------------------------------------------------------------

def _worker(out_path, model_flags, mechanisms, num_layers, num_blocks):
    """Runs inside each torchrun process: one step per mechanism (with and without caching), hop counters out."""
    import torch

    from harness import megatron_run, start, train_step
    from mega_depth.megatron.pipeline import pipelines_of

    world = start()
    records = []
    for name in mechanisms:
        for cache in (True, False):
            flags = model_flags + mechanism_flags(name, num_layers, attnres_num_blocks=num_blocks) + \
                ([] if cache else ["--no-vp-cache"])
            backend, sampler = megatron_run(flags, 64)
            train_step(backend, sampler.microbatches(0))
            hops = {}
            for pipe in pipelines_of(backend.model):  # standard: Megatron's own block, nothing counted
                hops = {k: [pipe.hops.widths[k], pipe.hops.bytes[k][0]] for k in pipe.hops.widths}
            records.append({"mechanism": name, "cache": cache, "hops": hops})
            backend.close()
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, records)
    if torch.distributed.get_rank() == 0:
        merged = {}
        for part in gathered:
            for r in part:
                key = (r["mechanism"], r["cache"])
                merged.setdefault(key, {}).update(r["hops"])
        with open(out_path, "w") as f:
            json.dump([{"mechanism": m, "cache": c, "hops": h} for (m, c), h in merged.items()], f)
    torch.distributed.destroy_process_group()


def _model_flags(args, pp: int, vpp: int) -> list:
    flags = ["--mock-data", "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
             "--num-attention-heads", str(args.num_attention_heads), "--num-query-groups", str(args.num_query_groups),
             "--seq-length", str(args.seq_length), "--vocab-size", "256", "--micro-batch-size", "1",
             "--global-batch-size", str(2 * pp), "--pipeline-model-parallel-size", str(pp), "--train-iters", "2"]
    if vpp > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(args.num_layers // (pp * vpp))]
    return flags



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--grid", default="2x1,2x2,4x1,4x2", help="comma-separated PxV")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--num-query-groups", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--attnres-num-blocks", type=int, default=4, help="blocks of Block AttnRes")
    parser.add_argument("--mechanisms", default=",".join(SETTINGS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args, trainer_flags = parser.parse_known_args(argv)
    mechanisms = parse_mechanisms(args.mechanisms)
    if args.worker:
        pp, vpp = map(int, args.grid.lower().split("x"))
        _worker(args.worker, _model_flags(args, pp, vpp) + trainer_flags, mechanisms, args.num_layers,
                args.attnres_num_blocks)
        return 0

    d, s, heads, groups = args.hidden_size, args.seq_length, args.num_attention_heads, args.num_query_groups
    hn = d // heads
    kv_units, v_units = groups * hn / d, heads * hn / d  # Depth-Attention: per-query-head values (default)
    report = []
    for cell in args.grid.split(","):
        pp, vpp = map(int, cell.lower().split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "hops.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(pp), "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(__file__), "--worker", out,
                   "--grid", cell] + [a for k, v in vars(args).items() if k not in ("worker", "grid", "out")
                                      for a in (f"--{k.replace('_', '-')}", str(v))] + trainer_flags
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                return 1
            measured = json.load(open(out))
        for r in measured:
            exp = expected_widths(r["mechanism"], args.num_layers, args.attnres_num_blocks, pp, vpp, r["cache"],
                                  kv_units, v_units)
            hops = {int(k): v for k, v in r["hops"].items()}
            if r["mechanism"] == "standard":  # Megatron's own block sends the [s, b, d] hidden state, uncounted
                hops = {stage: [d, s * d * 4] for stage in range(1, pp * vpp)}
            units = {k: v[0] / d for k, v in sorted(hops.items())}
            report.append({
                "mechanism": r["mechanism"], "P": pp, "V": vpp, "cache": r["cache"],
                "hop_units_of_d": units, "expected_units_of_d": exp,
                "bytes_per_hop": {k: v[1] for k, v in sorted(hops.items())},
                "peak_hop_bytes": max(v[1] for v in hops.values()),
                "total_bytes_per_microbatch": sum(v[1] for v in hops.values()),
                "matches_formula": None if exp is None else (all(abs(units[k] - exp[k]) < 1e-9 for k in exp)
                                                             and set(units) == set(exp)),
                "state_units_at_last_hop": units[max(units)],
            })
    base = {(r["P"], r["V"], r["cache"]): r["total_bytes_per_microbatch"] for r in report
            if r["mechanism"] == "standard"}
    for r in report:
        r["bytes_ratio_to_baseline"] = r["total_bytes_per_microbatch"] / base[(r["P"], r["V"], r["cache"])]
    print(f"\npipeline traffic per micro-batch ({args.num_layers} layers, d={d}, s={s}, fp32), widths in units of d")
    print(f"{'mechanism':<20}{'P':>3}{'V':>3} {'cache':<6}{'peak hop B':>11}{'total B':>10}{'x base':>8}  "
          f"{'formula':<8}widths per hop")
    for r in report:
        widths = " ".join(f"{w:g}" for w in r["hop_units_of_d"].values())
        print(f"{r['mechanism']:<20}{r['P']:>3}{r['V']:>3} {str(r['cache']):<6}{r['peak_hop_bytes']:>11}"
              f"{r['total_bytes_per_microbatch']:>10}{r['bytes_ratio_to_baseline']:>8.2f}  "
              f"{ {True: 'ok', False: 'MISMATCH', None: 'no formula'}[r['matches_formula']]:<8}{widths}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["matches_formula"] is not False for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
