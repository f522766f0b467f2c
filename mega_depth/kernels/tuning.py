"""Launch settings measured on a GPU: the warps of each kernel specialisation, and the warps its register cap
leaves resident, per GPU generation.

A launcher guesses both on a CPU: its warps from the values a thread holds (common.warps and the op's own rules),
the resident warps from what compiles without a spill (common.options). `tools/bench_kernels.py --tune` times
each guess's neighbours on a GPU, at the sizes the shipped configs launch, and writes the winners into
`tuned.json` beside this module, keyed by compute capability ("sm_90") and by the specialisation: the kernel,
its constexprs and the dtypes of its tensors. `common.launch` takes an entry where the running GPU's capability
has one, and the launcher's guess elsewhere.

The table is a file in the repository, not a cache filled while training: every rank of a job launches the same
settings (the warps set the order of a kernel's reductions), nothing is timed inside a step, and
tests/unit/test_kernels_aot.py compiles every launch with the table's settings for its target and fails on a
spill, as it does the guesses.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

SHIPPED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned.json")
# MEGA_DEPTH_TUNED_TABLE: another table, e.g. the one a tuning run just wrote, measured before it is committed
TABLE_PATH = os.environ.get("MEGA_DEPTH_TUNED_TABLE") or SHIPPED_PATH
if not os.path.exists(TABLE_PATH) and TABLE_PATH != SHIPPED_PATH:
    raise FileNotFoundError(f"MEGA_DEPTH_TUNED_TABLE={TABLE_PATH}: no such file; point it at a table that "
                            "tools/bench_kernels.py --tune wrote, or unset it for the shipped one")
Setting = Tuple[int, int]  # (num_warps, resident_warps)

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def load(path: str = TABLE_PATH) -> Dict[str, Dict[str, Setting]]:
    """{"sm_90": {key: (num_warps, resident_warps)}} from a tuned.json (empty where there is none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    table = {}
    for target, entries in raw.items():
        if not target.startswith("sm_") or not isinstance(entries, dict):
            raise ValueError(f"{path}: {target!r} is not a target like 'sm_90' mapping kernels to [warps, resident "
                             "warps]; regenerate it with tools/bench_kernels.py --tune")
        table[target] = {}
        for key, value in entries.items():
            if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
                raise ValueError(f"{path}: {target} {key}: {value!r} is not [warps, resident warps]; regenerate it "
                                 "with tools/bench_kernels.py --tune")
            table[target][key] = (value[0], value[1])
    return table


TABLE: Dict[str, Dict[str, Setting]] = load()
_FORCED: Dict[str, Setting] = {}  # bench_kernels --tune: a candidate setting, on any device
_OBSERVERS: List[List[Tuple[str, Setting]]] = []
_CAPABILITY: Dict[int, str] = {}
_LAST_OBSERVED: List[str] = []  # the key of the launch in progress, while observing
_GUESSED: Dict[str, Setting] = {}  # key -> the launcher's own guess, of the launches made while observing
_SPILLED: Dict[str, int] = {}  # key -> spilled bytes of a launch made while observing (a GPU's compile)


def kernel_name(kernel) -> str:
    """op module . kernel, e.g. attnres_mix._fwd_kernel (a JIT function, or the interpreter's)."""
    return f"{kernel.fn.__module__.rsplit('.', 1)[-1]}.{kernel.__name__}"


def key(kernel, args: Sequence[Any], constexprs: Mapping[str, Any]) -> str:
    """What a setting is chosen for: the kernel, its constexprs (the block shape and flags) and the dtypes of its
    floating tensors, e.g. "attnres_mix._fwd_kernel(BC=2048, BH=1, NORM=1, PER_TOKEN=1, SIGMOID=0) bf16,fp32"."""
    consts = ", ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(constexprs.items()))
    dtypes: List[str] = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and _DTYPES.get(a.dtype) not in dtypes:
            dtypes.append(_DTYPES.get(a.dtype, str(a.dtype)))
    return f"{kernel_name(kernel)}({consts}) {','.join(dtypes)}"


def target(capability: Tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _running_target(args: Sequence[Any]) -> Optional[str]:
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is None or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = target(torch.cuda.get_device_capability(index))
    return _CAPABILITY[index]


def active(kernel) -> bool:
    """Whether a launch of `kernel` must look its setting up: the tuner is forcing or observing, or the table holds
    an entry for the kernel on some target. Most kernels have none (5 of the table's 31 entries stayed after its
    audit of 2026-12-07), and the lookup (launch_setting: the tensors' dtypes and a tuple key, 13 us a launch on
    the H200's host under cProfile on 2026-12-04) is then skipped for the launcher's guess."""
    if _FORCED or _OBSERVERS:
        return True
    if not TABLE:
        return False
    _fresh()
    tabled = _TABLED.get(kernel)
    if tabled is None:
        prefix = kernel_name(kernel) + "("
        tabled = _TABLED[kernel] = any(k.startswith(prefix) for entries in TABLE.values() for k in entries)
    return tabled


def setting(kernel, args: Sequence[Any], constexprs: Mapping[str, Any], guess: Setting,
            target_name: Optional[str] = None) -> Setting:
    """The setting to launch (or, with target_name, to compile for that target): a forced one, else the table's
    entry for the running GPU's capability, else the launcher's guess."""
    k = key(kernel, args, constexprs)
    chosen = _FORCED.get(k) or TABLE.get(target_name or _running_target(args) or "", {}).get(k) or guess
    for seen in _OBSERVERS:
        seen.append((k, chosen))
    if _OBSERVERS:
        _LAST_OBSERVED[:] = [k]
        _GUESSED[k] = tuple(guess)
    return chosen


_CHOSEN: Dict[tuple, Setting] = {}  # a launch's cheap key -> setting(), for the table in _CHOSEN_FROM
_TABLED: Dict[Any, bool] = {}  # kernel -> whether the table in _CHOSEN_FROM has an entry for it (active)
_CHOSEN_FROM: List[Any] = [None]


def _fresh() -> None:
    """Forget what was looked up in a table that has since been replaced (a test's, or the tuner's update)."""
    if _CHOSEN_FROM[0] is not TABLE:
        _CHOSEN.clear()
        _TABLED.clear()
        _CHOSEN_FROM[0] = TABLE


def launch_setting(kernel, args: Sequence[Any], constexprs: Mapping[str, Any], guess: Setting) -> Setting:
    """setting() for a launch on the running GPU, remembered per kernel, constexprs, tensor dtypes, device and guess.
    key()'s string took 9 us a launch on the development VM, about 3 ms of host time in a 1B step of Block AttnRes
    (365 launches); this key is a tuple, about a third of that. Forced and observed launches take the slow path, as
    does the first launch of each kind."""
    if _FORCED or _OBSERVERS:
        return setting(kernel, args, constexprs, guess)
    _fresh()
    dtypes, device = [], None
    for a in args:
        if isinstance(a, torch.Tensor):
            dtypes.append(a.dtype)
            device = device or a.device
    cheap = (kernel, tuple(constexprs.items()), tuple(dtypes), device, guess)
    chosen = _CHOSEN.get(cheap)
    if chosen is None:
        chosen = _CHOSEN[cheap] = setting(kernel, args, constexprs, guess)
    return chosen


def measured(kernel, args: Sequence[Any], constexprs: Mapping[str, Any], target_name: str) -> bool:
    """Whether the table holds a GPU-measured setting for this launch on target_name (else it runs the guess)."""
    return key(kernel, args, constexprs) in TABLE.get(target_name, {})


def launched(compiled) -> None:
    """After a launch made while observing: the spills of its compile (Triton's n_spills on a GPU; nothing under
    the interpreter), which the tuner holds against a candidate: a faster setting that spills is not taken."""
    spills = getattr(compiled, "n_spills", 0) or 0
    if _OBSERVERS and _LAST_OBSERVED and spills:
        _SPILLED[_LAST_OBSERVED[0]] = max(spills, _SPILLED.get(_LAST_OBSERVED[0], 0))


def guessed(k: str) -> Optional[Setting]:
    """The launcher's own guess for key k, as its last observed launch made it (the tuner searches around it, and
    around a table entry that replaced it)."""
    return _GUESSED.get(k)


def spilled() -> Dict[str, int]:
    """{key: spilled bytes} of the launches made while observing, since the last clear_spilled()."""
    return dict(_SPILLED)


def clear_spilled() -> None:
    _SPILLED.clear()


@contextlib.contextmanager
def observing() -> Iterator[List[Tuple[str, Setting]]]:
    """Collects (key, setting) of every launch made inside."""
    seen: List[Tuple[str, Setting]] = []
    _OBSERVERS.append(seen)
    try:
        yield seen
    finally:
        _OBSERVERS.remove(seen)


@contextlib.contextmanager
def forcing(settings: Mapping[str, Setting]) -> Iterator[None]:
    """Launches the kernels of `settings`' keys with those settings, on any device (the tuner's candidates)."""
    previous = dict(_FORCED)
    _FORCED.update(settings)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(previous)


def candidates(guess: Setting) -> List[Setting]:
    """The guess and its neighbours: half, a quarter and twice the warps (1 to 16), each at the guess's resident
    warps, twice them and half them (a register cap half or twice as high; never under the block's own warps). The
    H200's winners of 2026-11-30 lay at half the warps, the edge of the neighbourhood searched then."""
    warps, resident = guess
    out = []
    for w in (warps, warps // 2, warps // 4, warps * 2):
        for r in (resident, resident * 2, resident // 2):
            if 1 <= w <= 16 and w <= r <= 64 and (w, r) not in out:
                out.append((w, r))
    return out


def merged(path: str, target_name: str,
           winners: Mapping[str, Optional[Setting]]) -> Dict[str, Dict[str, List[int]]]:
    """The table at `path` with `winners` written over the target's entries (other targets kept); a winner of None
    removes its key's entry (the launcher's guess measured fastest: it runs without one)."""
    table = {t: {k: list(v) for k, v in entries.items()} for t, entries in load(path).items()}
    table[target_name] = {k: list(v) for k, v in with_winners(table.get(target_name, {}), winners).items()}
    return {t: dict(sorted(entries.items())) for t, entries in sorted(table.items()) if entries}


def with_winners(entries: Mapping[str, Any], winners: Mapping[str, Optional[Setting]]) -> Dict[str, Any]:
    """A target's entries with `winners` written over them; a winner of None removes its key's entry."""
    out = {k: v for k, v in entries.items() if k not in winners}
    out.update({k: v for k, v in winners.items() if v is not None})
    return out
