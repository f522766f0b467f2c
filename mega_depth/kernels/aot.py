"""Ahead-of-time compilation of the Triton kernels for real GPU targets, on any machine.

The Triton interpreter checks values only: it accepts code that the compiler rejects and says nothing about
registers, spills or shared memory. Triton compiles for a GPU target without a GPU (`triton.compile` with a
`GPUTarget`), and the wheel's own `cuobjdump --dump-resource-usage` reads the cubin's registers, stack, local
memory (spills) and shared memory. This module compiles exactly what a training configuration launches:

1. `config_launches(cfg, dtype, sm_count)`: the mechanism of a config runs one forward and backward per pipeline
   chunk on meta tensors (no memory) at the config's real sizes and TP/SP split, on a stand-in host layer (the
   attention and MLP are identities behind the fused norm's choice of ops; Depth-Attention gets per-rank
   query/key/value heads), with and without the mixing's recomputation, while common.recording turns every Triton
   launch into a record (arguments, constexprs, warps, grids as a GPU with `sm_count` SMs).
2. `compile_launch(launch, capability)`: the launch's specialisation, made by Triton's own argument binder for
   that target (as the runtime would: pointer alignment, integer specialisation), compiled to a cubin.
3. `resources(compiled)`: REG / STACK / SHARED / LOCAL from cuobjdump, and the occupancy they imply.

tools/kernel_resources.py prints the table (docs/benchmarks.md keeps it); tests/unit/test_kernels_aot.py fails on
a compile error or a spill, for sm_80, sm_90 and sm_100, bf16 and fp32, over the shipped 125M / 1B / 7B configs.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from mega_depth.kernels import common, tuning
from mega_depth.kernels.common import Launch
from mega_depth.model.base import normed

# SMs, registers per SM, threads per SM and shared memory per SM (bytes) by compute capability (datasheets: A100,
# H100 SXM, B200)
TARGETS = {80: (108, 65536, 2048, 164 * 1024), 90: (132, 65536, 2048, 228 * 1024), 100: (148, 65536, 2048,
                                                                                        228 * 1024)}


# --------------------------------------------------------------------------------------------------------------
# 1. What a configuration launches
# --------------------------------------------------------------------------------------------------------------


class _Host:
    """A stand-in host layer (mega_depth/model/base.py's interface): identity attention and MLP on meta tensors,
    so that only the mechanism's mixing launches kernels. Depth-Attention's value mixer gets per-rank heads over
    the whole sequence (as attention sees them under SP), derived from the input so gradients flow."""

    def __init__(self, index: int, modules: Dict[str, nn.Module], heads: Tuple[int, int, int], seq: int,
                 qk_norm: bool = True):
        self.layer_index = index
        self._heads, self._seq = heads, seq
        self._head_norm = _HEAD_NORM if qk_norm else _identity  # the q/k norms (Megatron's IdentityOp without them)
        for name, module in modules.items():
            setattr(self, name, module)

    def attention_sublayer(self, x, k_in=None, v_in=None, value_mixer=None):
        x = normed(_NORM, x)
        out = x if k_in is None else x + k_in + v_in
        if value_mixer is not None:
            hq, hkv, hn = self._heads
            lead = (self._seq, x.shape[1])
            derived = x.sum() * 0  # keeps the graph connected to x
            query = torch.zeros(*lead, hq, hn, dtype=x.dtype, device=x.device) + derived
            key = torch.zeros(*lead, hkv, hn, dtype=x.dtype, device=x.device) + derived
            value = torch.zeros(*lead, hkv, hn, dtype=x.dtype, device=x.device) + derived
            mixed = value_mixer(query, key, value, self._head_norm, self._head_norm)
            out = out + sum(t.sum() for t in mixed) * 0
        return out

    def attention_sublayer_recomputed(self, make_inputs, sources, remakes=False):
        q_in, k_in, v_in = make_inputs(*sources).unbind(0)  # the plain composition, as the plain decoder's host
        return self.attention_sublayer(q_in, k_in, v_in), q_in

    def mlp_sublayer(self, x):
        return normed(_NORM, x) * 1


class _Norm:
    """The host's fused pre-norm, as far as the mixing's launches go: a sublayer input that the mechanism makes and
    normalises in one op (`Recomputed.normalised`) goes through that op, one it makes again in backward is made
    once (its second making launches the same kernel), and a plain tensor passes as it is."""

    eps = 1e-6

    def __call__(self, x):
        return x

    def remade(self, make, sources, normalised=None):
        if normalised is None:
            return make(*sources)
        row = max((t for t in sources if t is not None), key=lambda t: t.shape[-1])  # a [*, d] source
        return normalised(torch.ones(row.shape[-1], dtype=row.dtype, device=row.device), self.eps, *sources)


_NORM = _Norm()


class _HeadNorm:
    """The host's query or key norm (over a head's channels), as far as the mixing's launches go: a plain tensor
    passes as it is; an op that folds the norm into its own kernel (`folded`: Depth-Attention's mix, which normalises
    this layer's query and key and its candidates' keys) gets a weight."""

    eps = 1e-6

    def __call__(self, x):
        return x

    def folded(self, op, like):
        return op(torch.ones(like.shape[-1], dtype=like.dtype, device=like.device), self.eps)


_HEAD_NORM = _HeadNorm()


def _identity(x):
    return x


class _Final:
    def __init__(self, modules: Dict[str, nn.Module]):
        for name, module in modules.items():
            setattr(self, name, module)


def _chunks(num_layers: int, pp: int, vpp: int, recompute_layers: Optional[int]) -> List[Tuple[int, int]]:
    """The layer ranges the mechanism runs at once: pipeline chunks (StageGeometry's split), cut into recompute
    chunks under full recomputation."""
    per_stage = num_layers // (pp * vpp)
    out = []
    for start in range(0, num_layers, per_stage):
        step = recompute_layers or per_stage
        out += [(a, min(a + step, start + per_stage)) for a in range(start, start + per_stage, step)]
    return out


def config_launches(cfg, dtype: torch.dtype, sm_count: int) -> List[Launch]:
    """Every Triton launch of one training step's mixing (forward and backward) under `cfg` (a validated
    mega_depth.config.Config), with activations in `dtype`, on a GPU with `sm_count` SMs."""
    from mega_depth.kernels import fast_functions
    from mega_depth.model.registry import build

    p, m = cfg.parallel, cfg.model
    tp, sp = p.tensor_model_parallel_size, p.sequence_parallel
    shape = cfg.decoder_config().shape
    mechanism = build(cfg.residual, shape, tp, sp)
    if not mechanism.mixes_depth:
        return []
    mechanism.kernels = fast_functions()
    seq, batch = m.seq_length // p.context_parallel_size, cfg.training.micro_batch_size  # a CP rank's tokens
    local_seq = seq // tp if sp else seq
    heads = (shape.num_attention_heads // tp, shape.num_query_groups // tp, shape.head_dim)
    recompute = p.recompute_num_layers if p.recompute_granularity == "full" else None
    with torch.device("meta"):
        hosts = [_Host(i, {k: v.to(dtype) for k, v in mechanism.layer_modules(i, dtype).items()}, heads, seq,
                       shape.qk_norm) for i in range(m.num_layers)]
        final = _Final({k: v.to(dtype) for k, v in mechanism.final_modules(dtype).items()})
    with common.recording(sm_count) as launches:
        # without the mixing's recomputation and with it (the default): a recomputing step re-launches the same
        # kernels, but makes some sublayer inputs with the ops that also normalise them (`_Norm`)
        for recompute_mixing in (False, True):
            mechanism.recompute_mixing = recompute_mixing
            for first, end in _chunks(m.num_layers, p.pipeline_model_parallel_size, cfg.virtual_pipeline_size or 1,
                                      recompute):
                if first == 0:
                    x = torch.zeros(local_seq, batch, shape.hidden_size, dtype=dtype, device="meta",
                                    requires_grad=True)
                    state = mechanism.initial_state(x)
                else:
                    entries = {e.name: mechanism.unflat(e.name, torch.zeros(local_seq, batch, e.width, dtype=dtype,
                                                                            device="meta", requires_grad=True))
                               for e in mechanism.layout(first)}
                    state = mechanism.state_from(entries, first)
                state = mechanism.run_layers(hosts[first:end], state)
                outs = [mechanism.final_hidden(state, final)] if end == m.num_layers else \
                    list(mechanism.entries(state).values())
                loss = sum(o.float().sum() for o in outs if o.requires_grad)
                loss.backward()
    return launches


# --------------------------------------------------------------------------------------------------------------
# 2. Compilation for a target, as the runtime would specialise the launch
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Compiled:
    name: str
    key: str  # the specialisation: signature, constexprs and attributes (what the runtime caches on)
    ptx: str
    cubin: bytes
    num_warps: int
    shared: int


def _bind(launch: Launch, capability: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.constexprs, **common.options(launch.num_warps, launch.resident_warps))
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return target, options, signature, constexprs, attrs


def specialisation(launch: Launch) -> str:
    """What the Triton runtime would cache the launch's compiled kernel on (target aside)."""
    _, options, signature, constexprs, attrs = _bind(launch, 90)
    return repr((kernel_name(launch), sorted(signature.items()), sorted(constexprs.items()),
                 sorted(attrs.items()), options.num_warps, getattr(options, "maxnreg", None)))


def tuned(launch: Launch, capability: int) -> Launch:
    """The launch with the settings the GPU of `capability` would run it with (kernels/tuning.py's table)."""
    warps, resident = tuning.setting(launch.kernel, launch.args, launch.constexprs,
                                     (launch.num_warps, launch.resident_warps), f"sm_{capability}")
    return replace(launch, num_warps=warps, resident_warps=resident)


def compile_launch(launch: Launch, capability: int) -> Compiled:
    import triton
    from triton.compiler import ASTSource

    launch = tuned(launch, capability)
    target, options, signature, constexprs, attrs = _bind(launch, capability)
    kernel = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                            options=options.__dict__)
    return Compiled(kernel_name(launch), specialisation(launch), kernel.asm["ptx"], kernel.asm["cubin"],
                    options.num_warps, kernel.metadata.shared)


# --------------------------------------------------------------------------------------------------------------
# 3. Resources
# --------------------------------------------------------------------------------------------------------------


def _nvidia_tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(compiled: Compiled, capability: int) -> Dict[str, Any]:
    """{"registers", "stack" (bytes a thread), "shared" (bytes a block), "local" (bytes a thread), "spill_stores" /
    "spill_loads" (bytes a thread), "occupancy" (% of the 64 warps an SM holds), "narrow_loads" (global loads of
    2 bytes or less a thread), "widest_load" (bytes a thread), "load_wave" (bytes the resident threads of an SM
    ask for with one widest load each: what one load instruction puts in flight), "atomics" (global atomic
    instructions: a reduction whose order, and so whose fp32 rounding, varies from run to run), "barriers" (bar.sync
    instructions in the PTX: each a point where the program's warps wait for one another, as a reduction across
    warps or a layout change through shared memory does; counted once, in or out of a loop), "load_widths" ({bytes
    a thread, as a string: global loads of that width})} of a compiled kernel: the
    cubin's resource usage as cuobjdump --dump-resource-usage reads it, and the spills ptxas -v reports for its
    PTX (Triton runs ptxas with -v but keeps the report to itself; a spill goes to the stack frame, which cuobjdump
    shows as STACK, not LOCAL)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(compiled.cubin)
        with open(ptx, "w") as f:
            f.write(compiled.ptx)
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
        arch = sm_arch_from_capability(capability)
        report = subprocess.run([get_ptxas(capability).path, "-lineinfo", "-v", f"--gpu-name={arch}", ptx, "-o",
                                 os.path.join(tmp, "again.cubin")], capture_output=True, text=True, check=True).stderr
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    regs, shared = int(found["REG"]), max(int(found["SHARED"]), compiled.shared)
    resident = occupancy(regs, shared, compiled.num_warps, capability)
    widths = load_widths(compiled.ptx)
    widest = max(widths, default=0)
    return {"registers": regs, "stack": int(found["STACK"]), "shared": shared, "local": int(found["LOCAL"]),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)), "occupancy": resident,
            "narrow_loads": sum(count for size, count in widths.items() if size <= 2), "widest_load": widest,
            "load_wave": resident * 64 * 32 // 100 * widest, "atomics": global_atomics(compiled.ptx),
            "barriers": len(_BARRIER.findall(compiled.ptx)),
            "load_widths": {str(size): count for size, count in sorted(widths.items())}}


# A global load in PTX: ld.global[.nc][.L1::...].[v2|v4].<type> (predicated or not), or an asynchronous copy to
# shared memory (cp.async.{ca,cg}.shared.global [dst], [src], <bytes>).
_GLOBAL_LOAD = re.compile(r"^\s*(?:@!?%p\d+\s+)?ld\.global((?:\.[\w:]+)*)\s", re.M)
_LOAD_TYPE = re.compile(r"\.(?:v(\d+)\.)?[bsuf](8|16|32|64|128)$")
_ASYNC_COPY = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?cp\.async\.\w+\.shared\.global\s*\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-fA-F]+|\d+)", re.M)


# A barrier in PTX: bar.sync / barrier.sync (Triton's __syncthreads).
_BARRIER = re.compile(r"^\s*(?:@!?%p\d+\s+)?bar(?:rier)?\.sync\b", re.M)


# A global atomic in PTX: atom.global... or red.global... (predicated or not).
_GLOBAL_ATOMIC = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:atom|red)\.global\.", re.M)


def global_atomics(ptx: str) -> int:
    """The global atomic instructions in a kernel's PTX (tl.atomic_add and the like)."""
    return len(_GLOBAL_ATOMIC.findall(ptx))


def load_widths(ptx: str) -> Dict[int, int]:
    """{bytes one thread loads in one instruction: how many such global loads} in a kernel's PTX. A bf16 row read
    through a pointer whose alignment Triton cannot prove compiles to 2-byte loads (ld.global.b16); a row at
    bandwidth wants 16 (ld.global.v4.b32, or cp.async of 16 bytes)."""
    out: Dict[int, int] = {}
    for match in _GLOBAL_LOAD.finditer(ptx):
        kind = _LOAD_TYPE.search(match.group(1))
        if kind is None:
            raise ValueError(f"unreadable PTX load: ld.global{match.group(1)}")
        size = int(kind.group(1) or 1) * int(kind.group(2)) // 8
        out[size] = out.get(size, 0) + 1
    for match in _ASYNC_COPY.finditer(ptx):
        size = int(match.group(1), 0)
        out[size] = out.get(size, 0) + 1
    return out


def occupancy(registers: int, shared: int, num_warps: int, capability: int) -> int:
    """Resident warps per SM as a % of the 64 an SM can hold: blocks limited by registers (allocated per warp in
    units of 256), threads and shared memory."""
    _, regs_per_sm, threads_per_sm, smem_per_sm = TARGETS[capability]
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    blocks = min(regs_per_sm // (per_warp * num_warps), threads_per_sm // (32 * num_warps),
                 smem_per_sm // shared if shared else 32, 32)
    return round(100 * blocks * num_warps / 64)


def unique(launches: Sequence[Launch]) -> List[Launch]:
    """One launch per specialisation (a deep model launches the same compiled kernel many times)."""
    seen, out = set(), []
    for launch in launches:
        key = specialisation(launch)
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def describe(launch: Launch) -> str:
    """The constexprs that set a kernel's shape, for tables (block dims, flags)."""
    consts = ", ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in launch.constexprs.items())
    return f"{kernel_name(launch)}({consts}) warps={launch.num_warps}/{launch.resident_warps}"


def kernel_name(launch: Launch) -> str:
    """op module . kernel, e.g. attnres_mix._fwd_kernel."""
    return tuning.kernel_name(launch.kernel)

