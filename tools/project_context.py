"""Long context on paper: per-GPU activation memory and context-parallel traffic for the shipped configs.

    python tools/project_context.py [--configs 1b,7b|PATH.yaml] [--seq 32768,131072] [--cp 1,2,4,8,16]
        [--mfu 0.4] [--peak-tflops 989] [--link nvlink=450e9,ib=50e9] [--out proj.json]

For every config, sequence length s and context-parallel degree CP (s divisible by 2 x CP, and by CP x TP under
sequence parallelism), with the config's TP / SP / PP / recompute and one micro-batch:
- activation memory per GPU: the trainer's own estimate (mega_depth/training/report.py: Korthikanti et al. per
  layer on the s / CP tokens a rank holds, the depth state each mechanism carries, micro-batches in flight), for
  the standard residual and for the mechanism that carries the most;
- CP traffic per layer and micro-batch, per GPU: all-gather CP receives the other ranks' K and V
  ((CP - 1) / CP x s x 2 x groups / TP x head dim x 2 bytes) in forward, gathers them again in backward and
  reduce-scatters their gradients: 3 x the forward volume;
- one layer's training compute on a rank: its FLOPs on s / CP tokens (attention over the whole causal context
  included) / TP / (MFU x peak), against the traffic's time at each link: hidden when the traffic fits under it.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from project_pipeline import load_config, parse_links, projection_parser  # noqa: E402


def activation_gib(cfg, mechanism_name: str, seq: int, cp: int) -> float:
    from mega_depth.catalogue import residual_settings
    from mega_depth.model.config import ResidualConfig
    from mega_depth.model.registry import build
    from mega_depth.training.report import memory_estimate

    m, p = cfg.model, cfg.parallel
    cfg.model.seq_length, p.context_parallel_size = seq, cp
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 1, None
    mech = build(ResidualConfig(**residual_settings(mechanism_name, m.num_layers)), cfg.decoder_config().shape)
    units = sum(e.width for e in mech.layout(m.num_layers)) / m.hidden_size
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * cp
    return memory_estimate(cfg, 0, 1, 0, units, world).activations / 2**30


def traffic(cfg, seq: int, cp: int, links: dict, mfu: float, peak: float) -> dict:
    from mega_depth.training.flops import flops_per_token

    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
    hn = m.hidden_size // m.num_attention_heads
    kv_bytes = seq * 2 * (m.query_groups // tp) * hn * 2  # K and V of the whole sequence on one TP rank, bf16
    per_layer_bytes = 3 * kv_bytes * (cp - 1) / cp
    one_layer = flops_per_token(1, m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn_size, 0, seq)
    compute_s = one_layer * seq / cp / tp / (mfu * peak)
    out = {"cp_bytes_per_layer": per_layer_bytes, "layer_compute_s": compute_s}
    for link, bandwidth in links.items():
        out[f"{link}_s"] = per_layer_bytes / bandwidth
        out[f"{link}_hidden"] = per_layer_bytes / bandwidth <= compute_s
    return out


def main(argv=None) -> int:
    args = projection_parser(__doc__, seq="32768,131072", cp="1,2,4,8,16").parse_args(argv)

    from mega_depth.catalogue import SETTINGS

    links = parse_links(args.link)
    rows = []
    for config in args.configs.split(","):
        base = load_config(config)
        p = base.parallel
        print(f"\n{config}: {base.model.num_layers} layers, d={base.model.hidden_size}, TP {p.tensor_model_parallel_size}"
              f"{' + SP' if p.sequence_parallel else ''}, PP {p.pipeline_model_parallel_size}, recompute "
              f"{p.recompute_granularity or 'none'}, micro-batch 1, bf16; compute at {args.mfu:.0%} of "
              f"{args.peak_tflops:.0f} TFLOP/s")
        print(f"{'seq':>8}{'CP':>4}{'act GiB std':>13}{'act GiB max':>13}  {'(mechanism)':<18}{'CP MiB/layer':>14}"
              + "".join(f"{link + ' hidden':>15}" for link in links))
        for seq in map(int, args.seq.split(",")):
            for cp in map(int, args.cp.split(",")):
                tp = p.tensor_model_parallel_size
                if seq % (2 * cp) or (p.sequence_parallel and (seq // cp) % tp):
                    continue
                acts = {name: activation_gib(load_config(config), name, seq, cp) for name in SETTINGS}
                worst = max(acts, key=acts.get)
                row = dict(config=config, seq=seq, cp=cp, activation_gib=acts,
                           **traffic(load_config(config), seq, cp, links, args.mfu, args.peak_tflops * 1e12))
                rows.append(row)
                print(f"{seq:>8}{cp:>4}{acts['standard']:>13.2f}{acts[worst]:>13.2f}  {'(' + worst + ')':<18}"
                      f"{row['cp_bytes_per_layer'] / 2**20:>14.1f}"
                      + "".join(f"{('yes' if row[f'{link}_hidden'] else 'no'):>15}" for link in links))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
