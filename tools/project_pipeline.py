"""Scale on paper: what each mechanism's pipeline traffic costs across nodes, for the shipped configs.

    python tools/project_pipeline.py [--configs 1b,7b|PATH.yaml] [--pp 2,4,8] [--vpp 1,2,4] [--mfu 0.4]
        [--link nvlink=450e9,ib=50e9] [--peak-tflops 989] [--bytes-per-element 2] [--out proj.json]

For every catalogue setting, at each pipeline degree P and virtual stages V that divide the config's layers:
- bytes per hop (per TP rank, per micro-batch): the widths the mechanism's payload declares (mega_depth/model/*:
  layout, with the virtual-stage cache; tools/bench_comm.py checks them against the bytes the real p2p sends) x
  seq/TP under sequence parallelism (else seq) x micro-batch x 2 bytes (bf16); the peak over hops;
- hop time at each link bandwidth (defaults: NVLink 450 GB/s one way, InfiniBand 400 Gb/s = 50 GB/s);
- the compute of one model chunk per micro-batch: its layers' training FLOPs (3 x forward, as bench_throughput's
  formula) / TP / (MFU x peak);
- hidden: the forward activation and the backward gradient of a hop (2 x hop time) fit under one chunk's compute,
  which is what 1F1B / interleaved schedules with p2p overlap can hide; exposed: the rest, as a share of the chunk.
The table gives, per mechanism and link, the largest P (over the V tried) at which the traffic stays hidden.
"""

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str):
    """A shipped size (1b, 7b, ...: launch/configs/<name>-standard.yaml) or any YAML config file."""
    from mega_depth.config import parse_args

    path = name if name.endswith(".yaml") else os.path.join(ROOT, "launch", "configs", f"{name}-standard.yaml")
    cfg = parse_args(["--config", path])
    cfg.model.vocab_size = cfg.model.vocab_size or 32000
    return cfg


def projection_parser(doc: str, **defaults) -> argparse.ArgumentParser:
    """The arguments both projections take (sizes, the chip, the links); defaults: the tool's own (e.g. pp="2,4")."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    parser.add_argument("--configs", default="1b,7b")
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), default=default)
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak of the chip (H100/H200)")
    parser.add_argument("--link", default="nvlink=450e9,ib=50e9", help="name=bytes/s,...")
    parser.add_argument("--out", default=None)
    return parser


def parse_links(text: str) -> dict:
    """'nvlink=450e9,ib=50e9' -> {link: bytes/s}."""
    return {k: float(v) for k, v in (item.split("=") for item in text.split(","))}


def projection(cfg, mechanism_name: str, pp: int, vpp: int, links: dict, mfu: float, peak: float,
               bytes_per_element: int = 2) -> dict:
    from mega_depth.training.flops import flops_per_token
    from mega_depth.catalogue import residual_settings
    from mega_depth.megatron.pipeline import StageGeometry, hop_layout
    from mega_depth.model.config import ResidualConfig
    from mega_depth.model.registry import build

    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, sp = p.tensor_model_parallel_size, p.sequence_parallel
    residual = ResidualConfig(**residual_settings(mechanism_name, m.num_layers))
    dc = cfg.decoder_config()
    mech = build(residual, dc.shape, tp, sp)
    geo = StageGeometry(m.num_layers, pp, vpp)
    tokens_local = (m.seq_length // tp if sp else m.seq_length) * t.micro_batch_size
    hops = {}
    for stage in range(1, geo.num_stages):
        sent, _ = hop_layout(mech, geo, stage, cache=True)
        hops[stage] = sum(e.width for e in sent) * tokens_local * bytes_per_element
    peak_bytes = max(hops.values())
    per_token = flops_per_token(m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn_size,
                                m.vocab_size, m.seq_length)
    head = 3 * 2 * m.hidden_size * m.vocab_size  # the LM head is on the last stage only: leave it out
    chunk_flops = (per_token - head) / m.num_layers * geo.layers_per_stage * m.seq_length * t.micro_batch_size / tp
    compute_s = chunk_flops / (mfu * peak)
    out = {"mechanism": mechanism_name, "P": pp, "V": vpp, "peak_hop_bytes": peak_bytes,
           "hop_bytes": hops, "chunk_compute_s": compute_s}
    for link, bandwidth in links.items():
        comm = 2 * peak_bytes / bandwidth  # activation forward + gradient backward
        out[f"{link}_hop_pair_s"] = comm
        out[f"{link}_hidden"] = comm <= compute_s
        out[f"{link}_exposed_share"] = max(0.0, comm - compute_s) / compute_s
    return out


def main(argv=None) -> int:
    parser = projection_parser(__doc__, pp="2,4,8", vpp="1,2,4")
    parser.add_argument("--mechanisms", default=None)
    parser.add_argument("--bytes-per-element", type=int, default=2, help="2: bf16 training; 4: fp32")
    args = parser.parse_args(argv)

    from mega_depth.catalogue import SETTINGS, parse_mechanisms

    names = parse_mechanisms(args.mechanisms) if args.mechanisms else list(SETTINGS)
    links = parse_links(args.link)
    rows = []
    for config in args.configs.split(","):
        cfg = load_config(config)
        for name in names:
            for pp in map(int, args.pp.split(",")):
                for vpp in map(int, args.vpp.split(",")):
                    if cfg.model.num_layers % (pp * vpp) or pp * vpp > cfg.model.num_layers:
                        continue
                    rows.append(dict(projection(cfg, name, pp, vpp, links, args.mfu, args.peak_tflops * 1e12,
                                                args.bytes_per_element), config=config))
    summary = []
    for config in args.configs.split(","):
        cfg = load_config(config)
        m, p = cfg.model, cfg.parallel
        print(f"\n{config}: {m.num_layers} layers, d={m.hidden_size}, seq {m.seq_length}, micro-batch "
              f"{cfg.training.micro_batch_size}, TP {p.tensor_model_parallel_size}"
              f"{' + SP' if p.sequence_parallel else ''}; bf16; chunk compute at {args.mfu:.0%} of "
              f"{args.peak_tflops:.0f} TFLOP/s")
        print(f"{'mechanism':<20}" + "".join(f"{'largest hidden P (' + link + ')':>26}" for link in links)
              + f"{'peak hop MiB at P=8,V=1':>26}")
        for name in names:
            mine = [r for r in rows if r["config"] == config and r["mechanism"] == name]
            best = {link: max([r["P"] for r in mine if r[f"{link}_hidden"]], default=None) for link in links}
            at8 = [r["peak_hop_bytes"] for r in mine if r["P"] == 8 and r["V"] == 1]
            summary.append({"config": config, "mechanism": name, **{f"largest_hidden_pp_{k}": v for k, v in
                                                                    best.items()}})
            print(f"{name:<20}" + "".join(f"{str(best[link] or '-'):>26}" for link in links)
                  + f"{(at8[0] / 2**20 if at8 else math.nan):>26.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
