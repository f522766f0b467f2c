"""The registry: every mechanism by `--residual` name, and the catalogue of named settings built from them.

Adding a mechanism is one file beside this one (a `Mechanism` subclass, base.py) plus its line below.
The import lines are `from .x import Y` so that an exported Hugging Face folder's remote-code loader finds them.
"""

from __future__ import annotations

from typing import Dict, List

from .attnres import AttnRes
from .base import Mechanism
from .dca import DCA
from .denseformer import DenseFormer
from .depth_attention import DepthAttention
from .hc import HC
from .mhc import MHC
from .standard import Standard

MECHANISMS: Dict[str, type] = {m.name: m for m in (Standard, AttnRes, DCA, DepthAttention, HC, MHC, DenseFormer)}


def mechanism_class(name: str) -> type:
    if name not in MECHANISMS:
        raise ValueError(f"unknown --residual {name!r}; choose one of {', '.join(MECHANISMS)}")
    return MECHANISMS[name]


def build(residual, shape, tp: int = 1, sp: bool = False) -> Mechanism:
    """The mechanism instance of a ResidualConfig for a decoder of `shape` (TP/SP only set payload widths)."""
    return mechanism_class(residual.mechanism)(residual, shape, tp, sp)


def catalogue(num_layers: int) -> Dict[str, Dict[str, object]]:
    """Every named setting (the rows of benchmark tables, layout tests and shipped configs), in registry order."""
    out: Dict[str, Dict[str, object]] = {}
    for mech in MECHANISMS.values():
        out.update(mech.catalogue(num_layers))
    return out


def owner_of(param_name: str) -> List[type]:
    """The mechanisms a parameter name belongs to (empty for the transformer's own parameters)."""
    return [m for m in MECHANISMS.values() if m.owns(param_name)]
