"""One training step of the real Megatron-core model, traced on meta tensors at any size: what it asks of a GPU.

No memory is allocated and nothing is computed: the model is built on the meta device (its keyed initialisation
skipped), one micro-batch goes forward and backward, and

- every aten op is recorded by a TorchDispatchMode with the bytes it reads and writes (views move none; a
  broadcast input counts its distinct elements once);
- GEMMs (mm, addmm, bmm, baddbmm) are listed with their shapes and FLOPs, and attention (SDPA) apart;
- every Triton launch of the mixing kernels is recorded instead of run (kernels/common.recording, as the
  ahead-of-time compile check does), with the grid a GPU with `sm_count` SMs would get, and its bytes
  (kernels/common.launch_bytes, the rows behind pointer tables included: what Mechanism.kernel_io_units models);
  other libraries' Triton
  kernels (Liger-Kernel's fused norm) are recorded at Triton's launcher with the bytes of their tensor arguments;
- the host-side counts: aten ops, Triton launches, custom-op calls and nested backward passes (recomputation).

`memory_bound_bytes` is what runs as eager memory-bound kernels outside the mixing's Triton kernels: the traffic
that fused kernels (a fused RMSNorm, RoPE, SwiGLU, the mixing's own kernels) would remove. tools/step_trace.py
prints the tables and the difference of each setting from the baseline.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mega_depth.kernels.common import launch_bytes, tensor_bytes

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
         aten.mm.out, aten.addmm.out, aten.bmm.out, aten.baddbmm.out}  # .out: into a given buffer
# Ops that allocate or alias without touching memory
_NO_TRAFFIC = {aten._unsafe_view.default, aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
               aten.new_empty.default, aten.new_empty_strided.default, aten.detach.default, aten.lift_fresh.default}


def _tensors(tree) -> List[torch.Tensor]:
    flat, _ = torch.utils._pytree.tree_flatten(tree)
    return [x for x in flat if isinstance(x, torch.Tensor)]


@dataclass
class Gemm:
    op: str
    shapes: Tuple[Tuple[int, ...], ...]  # the operands' shapes, in order
    flops: int


@dataclass
class StepTrace:
    ops: Counter = field(default_factory=Counter)  # aten op -> calls
    op_bytes: Counter = field(default_factory=Counter)  # memory-bound aten op -> bytes read + written
    gemms: List[Gemm] = field(default_factory=list)
    attention_calls: int = 0
    triton_launches: List = field(default_factory=list)
    library_launches: List[Tuple[str, int]] = field(default_factory=list)  # (kernel, tensor bytes) of other libraries
    custom_op_calls: int = 0
    backward_passes: int = 0  # autograd.backward / grad calls (1 for the step; more from recomputation)

    @property
    def memory_bound_bytes(self) -> int:
        return sum(self.op_bytes.values())

    @property
    def aten_calls(self) -> int:
        return sum(self.ops.values())

    def gemm_list(self) -> List[Tuple[str, Tuple[Tuple[int, ...], ...]]]:
        """The GEMMs as (op, operand shapes), sorted: what two settings must share to cost the same FLOPs."""
        return sorted((g.op, g.shapes) for g in self.gemms)

    @property
    def gemm_flops(self) -> int:
        return sum(g.flops for g in self.gemms)


def _gemm_flops(func, args) -> int:
    packet = func.overloadpacket
    a, b = args[:2] if packet in (aten.mm, aten.bmm) else args[1:3]
    if packet in (aten.mm, aten.addmm):
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: StepTrace):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        namespace = getattr(func, "namespace", "aten")
        if namespace != "aten":
            self.trace.custom_op_calls += 1
            return out
        self.trace.ops[name] += 1
        if func in GEMMS:
            operands = args[:2] if func.overloadpacket in (aten.mm, aten.bmm) else args[1:3]
            self.trace.gemms.append(Gemm(name, tuple(tuple(t.shape) for t in operands), _gemm_flops(func, args)))
        elif not (func in _NO_TRAFFIC or func.is_view):
            # read every tensor argument, write every output (an in-place op's output is its argument: once)
            moved = sum(tensor_bytes(t) for t in _tensors((args, kwargs)))
            moved += sum(tensor_bytes(t) for t in _tensors(out)) if not name.endswith("_") else 0
            self.trace.op_bytes[name] += moved
        return out


class _Attention(torch.autograd.Function):
    """SDPA as one opaque call (a fused flash / memory-efficient kernel on a GPU, compute-bound: not memory-bound
    traffic); on meta tensors torch would decompose it into its math path's batched GEMMs."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.shapes = (q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.empty_like(t) for t in ctx.shapes)


@contextlib.contextmanager
def _recorded_library_kernels(trace: Optional[StepTrace]):
    """Triton kernels launched by other libraries (kernel[grid](...) reaches JITFunction.run, or
    InterpretedFunction.run where TRITON_INTERPRET=1 was set before triton's import): recorded with the bytes of
    their tensor arguments, not run (their tensors are meta)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    kinds = (JITFunction, InterpretedFunction)
    runs = [kind.run for kind in kinds]

    def recorded(self, *args, grid, warmup, **kwargs):
        if trace is not None:  # None: skipped, not recorded (HostTimer)
            trace.library_launches.append((self.fn.__name__,
                                           sum(tensor_bytes(t) for t in _tensors((args, kwargs)))))

    for kind in kinds:
        kind.run = recorded
    try:
        yield
    finally:
        for kind, run in zip(kinds, runs):
            kind.run = run


@contextlib.contextmanager
def _gemms_left_unrun():
    """The GEMMs of CPU tensors return uninitialised outputs of their shape (as the recorded Triton launches leave
    theirs unwritten), for the host timer: a GEMM is the device's work, and a CPU without bf16 matrix units takes
    about 1 ms for the toy widths' [64, 64] x [64, 192] in bf16, 30x its fp32 time: its arithmetic would outweigh the
    host's work and shrink every ratio. The stand-in costs the host a Python call, about what a GPU's GEMM costs it
    to launch. Autograd still records each GEMM (its kernel sits below the autograd key)."""
    import warnings

    def empty(shape, like):
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    kernels = {
        "mm": lambda a, b: empty((a.shape[0], b.shape[1]), a),
        "addmm": lambda c, a, b, beta=1, alpha=1: empty((a.shape[0], b.shape[1]), a),
        "bmm": lambda a, b: empty((a.shape[0], a.shape[1], b.shape[2]), a),
        "baddbmm": lambda c, a, b, beta=1, alpha=1: empty((a.shape[0], a.shape[1], b.shape[2]), a),
        "mm.out": lambda a, b, out: out,
        "addmm.out": lambda c, a, b, beta=1, alpha=1, out=None: out,
        "bmm.out": lambda a, b, out: out,
        "baddbmm.out": lambda c, a, b, beta=1, alpha=1, out=None: out,
    }
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": the point, undone below
            warnings.simplefilter("ignore")
            for op, kernel in kernels.items():
                library.impl(op, kernel, "CPU")
        yield
    finally:
        library._destroy()  # the CPU kernels registered before are the ones that run again


@contextlib.contextmanager
def _opaque_attention(trace: StepTrace):
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, *args, **kwargs):
        trace.attention_calls += 1
        return _Attention.apply(q, k, v)

    F.scaled_dot_product_attention = recorded
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


@contextlib.contextmanager
def _counting_backward_passes(trace: StepTrace):
    """Count autograd.backward and autograd.grad calls (each a pass through the engine: the step's own, and one
    per recomputed region)."""
    backward, grad = torch.autograd.backward, torch.autograd.grad

    def counted_backward(*a, **k):
        trace.backward_passes += 1
        return backward(*a, **k)

    def counted_grad(*a, **k):
        trace.backward_passes += 1
        return grad(*a, **k)

    torch.autograd.backward, torch.autograd.grad = counted_backward, counted_grad
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad = backward, grad


def build_on_meta(cfg) -> List[torch.nn.Module]:
    """The Megatron-core model chunks of this rank on the meta device, as a GPU builds them (the fused SwiGLU
    switch set where Liger-Kernel is installed), the keyed initialisation skipped (the parallel state must be
    initialised)."""
    from mega_depth.megatron import builder, swiglu

    init, force = builder.init_layout_independent, swiglu.FORCE
    builder.init_layout_independent, swiglu.FORCE = (lambda *a, **k: None), True
    try:
        with torch.device("meta"):
            chunks = builder.build_model_chunks(cfg)
    finally:
        builder.init_layout_independent, swiglu.FORCE = init, force
    for chunk in chunks:  # tensors megatron-core puts on the CPU explicitly (RoPE's inverse frequencies)
        for module in chunk.modules():
            for key, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    setattr(module, key, value.to("meta"))
    return chunks


def trace_step(cfg, sm_count: int = 132) -> StepTrace:
    """One micro-batch forward and backward of the whole model (pipeline size 1) on meta tensors."""
    from mega_depth.kernels import common
    from mega_depth.megatron.pipeline import pipelines_of

    (model,) = build_on_meta(cfg)
    s, b = cfg.model.seq_length, cfg.training.micro_batch_size
    tokens = torch.zeros(b, s, dtype=torch.long, device="meta")
    positions = torch.zeros(b, s, dtype=torch.long, device="meta")
    trace = StepTrace()
    for pipe in pipelines_of([model]):
        pipe.start_step()
    with common.recording(sm_count) as launches, _counting_backward_passes(trace), _opaque_attention(trace), \
            _recorded_library_kernels(trace), _Recorder(trace):
        per_token = model(tokens, positions, attention_mask=None, labels=tokens)  # [b, s] fp32
        loss = per_token.float().mean()
        loss.backward()
    trace.triton_launches = list(launches)
    return trace


class HostTimer:
    """The model of `cfg` built once; calling it times the host's CPU time of one micro-batch forward and backward,
    `repeats` times after a warm-up: Python, autograd, the dispatcher and the launchers' own Python, at the config's
    sizes on the CPU (give it toy widths: the host's work does not depend on them, and the CPU's arithmetic then
    costs little). The mixing's and other libraries' Triton launches are recorded instead of run (their outputs are
    left unwritten, denormals flushed), as on meta tensors, and so are the GEMMs (`_gemms_left_unrun`), but the
    other aten ops run their C++ CPU kernels as a GPU's dispatch would: meta tensors would run Python meta functions
    instead and overstate the elementwise ops' cost. What remains for a GPU is the driver's few microseconds a
    launch (the step trace counts the launches).

    `python_calls()` counts the calls one pass makes from Python (Python functions and C functions alike): the
    host's work without the machine's noise, which on a shared VM moves a timed pass by 20 % and more."""

    def __init__(self, cfg, sm_count: int = 132):
        from mega_depth.megatron import builder, swiglu

        force = swiglu.FORCE
        swiglu.FORCE = True  # Megatron's fused-activation switch as a GPU sets it (the Liger kernel is recorded)
        try:
            (self.model,) = builder.build_model_chunks(cfg)
        finally:
            swiglu.FORCE = force
        s, b = cfg.model.seq_length, cfg.training.micro_batch_size
        self.tokens = torch.zeros(b, s, dtype=torch.long)
        self.positions = torch.arange(s).expand(b, s)
        self.sm_count = sm_count

    @contextlib.contextmanager
    def _pass(self):
        from mega_depth.kernels import common
        from mega_depth.megatron.pipeline import pipelines_of

        for pipe in pipelines_of([self.model]):
            pipe.start_step()
        self.model.zero_grad(set_to_none=True)
        with common.recording(self.sm_count), _recorded_library_kernels(None), _gemms_left_unrun():
            yield

    def _step(self) -> None:
        self.model(self.tokens, self.positions, attention_mask=None, labels=self.tokens).float().mean().backward()

    def __call__(self, repeats: int) -> List[float]:
        import time

        times = []
        torch.set_flush_denormal(True)
        try:
            for _ in range(repeats + 1):
                with self._pass():
                    start = time.process_time()
                    self._step()
                    times.append(time.process_time() - start)
        finally:
            torch.set_flush_denormal(False)
        return times[1:]

    def python_calls(self) -> int:
        """Calls made from Python in one pass after a warm-up (sys.setprofile's call and c_call events)."""
        import sys

        calls = 0

        def count(frame, event, arg):
            nonlocal calls
            if event == "call" or event == "c_call":
                calls += 1

        self(0)  # warm: caches filled, as in a timed pass
        with self._pass():
            sys.setprofile(count)
            try:
                self._step()
            finally:
                sys.setprofile(None)
        return calls


def summary(trace: StepTrace) -> Dict[str, float]:
    return {"aten_calls": trace.aten_calls, "memory_bound_gb": trace.memory_bound_bytes / 1e9,
            "mixing_kernel_gb": sum(launch_bytes(launch) for launch in trace.triton_launches) / 1e9,
            "gemm_calls": len(trace.gemms), "bmm_calls": sum(g.op in ("bmm", "baddbmm") for g in trace.gemms),
            "gemm_tflops": trace.gemm_flops / 1e12, "attention_calls": trace.attention_calls,
            "triton_launches": len(trace.triton_launches) + len(trace.library_launches),
            "library_kernel_gb": sum(b for _, b in trace.library_launches) / 1e9,
            "custom_op_calls": trace.custom_op_calls,
            "backward_passes": trace.backward_passes}
