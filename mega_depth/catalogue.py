"""The named settings that tools, tests and launch configs compare ("attnres-block", "dca-2", ...).

Each mechanism names its own settings (Mechanism.catalogue in its file); this module lists them in registry order
and turns them into trainer flags, so that a benchmark, a layout test and a shipped config mean the same thing by
"Block AttnRes" or "Depth-Attention".
"""

from typing import Dict, List

from mega_depth.model.config import option_flag
from mega_depth.model.registry import catalogue, mechanism_class

SETTINGS = tuple(catalogue(8))  # the names; the settings themselves may scale with depth


def residual_settings(name: str, num_layers: int, **overrides) -> Dict[str, object]:
    """`ResidualConfig` fields of the named setting for a model of `num_layers` layers. An override replaces a
    field the setting has (e.g. attnres_num_blocks=3 for a block that straddles a pipeline stage in tests).
    A variant adds options to a named setting: "attnres-input-query+attnres_query_scale=rsqrt_d" (benchmarks
    compare readings of one mechanism this way without a catalogue entry each)."""
    base, *extras = name.split("+")
    settings = catalogue(num_layers)
    if base not in settings:
        raise ValueError(f"unknown mechanism {base!r}; choose from {', '.join(settings)}")
    out = dict(settings[base])
    out.update({k: v for k, v in overrides.items() if k in out and v is not None})
    options = {o.name: o for o in mechanism_class(out["mechanism"]).options}
    for extra in extras:
        key, _, text = extra.partition("=")
        if key not in options or not text:
            raise ValueError(f"{extra!r} in {name!r} is not OPTION=VALUE of {out['mechanism']} (options: "
                             f"{', '.join(options)})")
        kind = options[key].type
        out[key] = text.lower() in ("1", "true", "yes") if kind is bool else kind(text)
    return out


def mechanism_flags(name: str, num_layers: int, **overrides) -> List[str]:
    """The same settings as trainer flags, e.g. ['--residual', 'attnres', '--attnres-num-blocks', '8']."""
    flags = []
    for key, value in residual_settings(name, num_layers, **overrides).items():
        flag = option_flag(key)
        flags += [flag if value is True else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, str(value)]
    return flags


def parse_mechanisms(spec: str) -> List[str]:
    """A comma-separated list from a `--mechanisms` flag, checked against the catalogue."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n.split("+")[0] not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown mechanism(s) {unknown} in --mechanisms; choose from {', '.join(SETTINGS)}")
    return names
