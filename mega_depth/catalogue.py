"""The six residual settings that tools, tests and launch configs compare, scaled to the model depth.

One place, so that a benchmark, a layout test and a shipped config mean the same thing by "Block AttnRes" or
"Depth-Attention". Each entry is a set of `ResidualConfig` fields; `mechanism_flags` turns it into CLI flags.
"""

from typing import Dict, List, Optional

MECHANISMS = ("standard", "attnres-full", "attnres-block", "dca", "dca-2", "depth-attention")


def residual_settings(name: str, num_layers: int, attnres_num_blocks: Optional[int] = None,
                      depth_attn_stride: Optional[int] = None) -> Dict[str, object]:
    """`ResidualConfig` fields of mechanism `name` for a model of `num_layers` transformer layers.

    Block AttnRes uses 8 blocks (the paper's setting), at most one per layer; Depth-Attention mixes every
    (L/2)-th layer plus the previous one (the released 3B model: 48 layers, stride 24, window 0 plus the residual).
    """
    if name == "standard":
        return {"residual": "standard"}
    if name == "attnres-full":
        return {"residual": "attnres"}
    if name == "attnres-block":
        return {"residual": "attnres", "attnres_num_blocks": attnres_num_blocks or min(8, num_layers)}
    if name == "dca":
        return {"residual": "dca"}
    if name == "dca-2":
        return {"residual": "dca", "dca_last_k": 2}
    if name == "depth-attention":
        return {"residual": "depth-attention", "depth_attn_stride": depth_attn_stride or max(1, num_layers // 2),
                "depth_attn_window": 1}
    raise ValueError(f"unknown mechanism {name!r}; choose from {', '.join(MECHANISMS)}")


def mechanism_flags(name: str, num_layers: int, **overrides) -> List[str]:
    """The same settings as `mega_depth.train` flags, e.g. ['--residual', 'attnres', '--attnres-num-blocks', '8']."""
    flags = []
    for key, value in residual_settings(name, num_layers, **overrides).items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


def parse_mechanisms(spec: str) -> List[str]:
    """A comma-separated list from a `--mechanisms` flag, checked against the catalogue."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in MECHANISMS]
    if unknown:
        raise SystemExit(f"unknown mechanism(s) {unknown} in --mechanisms; choose from {', '.join(MECHANISMS)}")
    return names
