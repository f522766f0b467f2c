"""What every op module of mega_depth/kernels shares.

- The optional triton import: without triton (a CPU install without the test extra) the op modules still import;
  `jit` then leaves a kernel undecorated and only the torch twins run.
- Dispatch: the Triton kernels run for CUDA tensors, or for any tensor while FORCE_TRITON is set (env
  MEGA_DEPTH_KERNELS_FORCE_TRITON=1 at import, or assign this module's attribute; with TRITON_INTERPRET=1 the
  kernels then run on CPU tensors, as the tests do), or while launches are being recorded. Otherwise (CPU tensors,
  fp64, no triton) the op's torch twin runs: the same computation, one source in flight at a time.
- Launch heuristics (`pow2`, `warps`, `programs`) and `launch`, the one place a kernel is started. Under
  `recording(sm_count)` nothing runs: each launch is recorded with its arguments, and the heuristics decide as
  they would on a GPU with that many SMs. Meta tensors go through the launchers this way, so the ahead-of-time
  compile check (kernels/aot.py) compiles exactly what a configuration launches.
- `pointer_table`: how a kernel reads a set of tensors without stacking them, copied to the device from pinned
  memory without a host sync.
- Shape helpers of the autograd glue, the twins' numeric helpers, and the jit helpers the kernels share.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from mega_depth.kernels import graph_tables, tuning

try:  # triton is optional: without it every device runs the torch twins
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - depends on the environment
    triton = tl = None
    TRITON_IMPORT_ERROR = exc

FORCE_TRITON = os.environ.get("MEGA_DEPTH_KERNELS_FORCE_TRITON", "0") == "1"
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
F32 = torch.float32

Sources = Union[Tensor, Sequence[Tensor]]
# Warps an SM keeps resident by default (the register cap, options): 4 blocks of 4 warps, a quarter of the 64 an
# SM holds, at most 128 registers a thread. A memory-bound kernel needs loads in flight; they come from warps.
RESIDENT_WARPS = 16


def jit(fn):
    """triton.jit where triton is installed; the plain function otherwise (never launched: the twins run)."""
    return triton.jit(fn) if triton is not None else fn


def triton_available() -> bool:
    return triton is not None


# Read once, at import, as triton.jit reads it when it decorates the kernels (an environment read is a
# microsecond of host time, and launches asked several times each)
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Whether the kernels run under Triton's interpreter (TRITON_INTERPRET=1 when this module was imported)."""
    return _INTERPRETING


# --------------------------------------------------------------------------------------------------------------
# Recording launches (the ahead-of-time compile check) and launching
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the JIT function, its grid, its runtime arguments (tensors, ints, floats) in order, its
    constexpr keyword arguments and its warps."""

    kernel: Any
    grid: Tuple[int, ...]
    args: Tuple[Any, ...]
    constexprs: Dict[str, Any]
    num_warps: int
    adds_into: Tuple[Any, ...] = ()  # tensor arguments the kernel adds to (read and written): launch_bytes
    resident_warps: int = RESIDENT_WARPS  # the register cap's aim (options)


@dataclass
class _Recorder:
    sm_count: int
    launches: List[Launch] = field(default_factory=list)


_RECORDER: Optional[_Recorder] = None


@contextlib.contextmanager
def recording(sm_count: int) -> Iterator[List[Launch]]:
    """Record launches instead of running them, deciding grids as a GPU with `sm_count` SMs would."""
    global _RECORDER
    previous, _RECORDER = _RECORDER, _Recorder(sm_count)
    try:
        yield _RECORDER.launches
    finally:
        _RECORDER = previous


def is_recording() -> bool:
    return _RECORDER is not None


def launch(kernel, grid: Sequence[int], args: Sequence[Any], num_warps: int, adds_into: Sequence[Any] = (),
           resident_warps: int = RESIDENT_WARPS, **constexprs) -> None:
    """kernel[grid](*args, **constexprs) with num_warps, or recorded. adds_into: the tensor arguments that the
    kernel adds to rather than overwrites (for the recorded launch's bytes). resident_warps: how many warps of
    this kernel the register cap leaves room for on one SM (options)."""
    if _RECORDER is not None:
        _RECORDER.launches.append(Launch(kernel, tuple(grid), tuple(args), dict(constexprs), num_warps,
                                         tuple(adds_into), resident_warps))
        return
    if not tuning.active(kernel):
        kernel[tuple(grid)](*args, **constexprs, **options(num_warps, resident_warps))
        return
    # a GPU-measured setting for this kernel and GPU (kernels/tuned.json), or the tuner's candidate
    num_warps, resident_warps = tuning.launch_setting(kernel, args, constexprs, (num_warps, resident_warps))
    tuning.launched(kernel[tuple(grid)](*args, **constexprs, **options(num_warps, resident_warps)))


def launch_bytes(launch: Launch) -> int:
    """The least DRAM traffic of a recorded launch: every distinct tensor it is given touched once (read or
    written), the rows behind its pointer tables included, and a gradient buffer that the kernel adds to (a
    gradient table's low bit, or one of the launch's `adds_into`) read as well. What the kernel re-reads from cache
    within the launch is not traffic; a second launch over the same rows is (the I/O models count launches alike)."""
    seen: Dict[int, int] = {}

    def touch(t: Tensor, times: int = 1) -> None:
        key = id(t)
        seen[key] = max(seen.get(key, 0), times * tensor_bytes(t))

    added = {id(t) for t in launch.adds_into}
    for arg in launch.args:
        if not isinstance(arg, Tensor):
            continue
        rows = getattr(arg, "_mega_depth_rows", None)
        if rows is None:
            touch(arg, 2 if id(arg) in added else 1)
            continue
        for t, bit in zip(*rows):
            touch(t, 2 if bit & 1 else 0 if bit & 2 else 1)  # added to / deferred (a placeholder)
    return sum(seen.values())


def tensor_bytes(t: Tensor) -> int:
    """The bytes a kernel reads or writes of `t`: its elements, a broadcast (stride 0) dimension counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def options(num_warps: int, resident_warps: int = RESIDENT_WARPS) -> Dict[str, int]:
    """Triton's launch options for a program of num_warps warps. maxnreg: the register file (64K) split between
    `resident_warps` warps, or the block's own warps where it has more (at most 255 registers a thread). Left to
    itself ptxas caps a 16-warp kernel at 64 registers, aiming at two blocks an SM, and spills where the kernel
    holds whole rows; given the whole file, a 4-warp kernel took up to 248 and left 2 blocks (8 warps) an SM: too
    few loads in flight. A launcher whose kernel needs more registers than the default leaves (they would spill)
    asks for fewer resident warps, one that holds little asks for more; tests/unit/test_kernels_aot.py compiles
    every launch of the shipped configs and fails on a spill."""
    if interpreting():
        return {"num_warps": num_warps}
    return {"num_warps": num_warps, "maxnreg": min(255, 65536 // (32 * max(num_warps, resident_warps))) // 8 * 8}


def register_fake(op):
    """@register_fake(op) over a function that returns an op's output metadata: its fake implementation (for
    torch.compile and meta tensors). While launches are recorded the op's own implementation runs instead: on meta
    tensors its Triton launchers allocate the outputs and record what they would launch (kernels/aot.py)."""
    def register(shapes):
        def fake(*args, **kwargs):
            return op._init_fn(*args, **kwargs) if _RECORDER is not None else shapes(*args, **kwargs)

        op.register_fake(fake)
        return shapes
    return register


def uses_triton(t: Tensor) -> bool:
    """Whether an op runs its Triton kernels for inputs like `t` (else its torch twin)."""
    return triton is not None and t.dtype in TRITON_DTYPES and (t.is_cuda or FORCE_TRITON or _RECORDER is not None)


# --------------------------------------------------------------------------------------------------------------
# Launch heuristics
# --------------------------------------------------------------------------------------------------------------


def pow2(n: int) -> int:
    """The next power of two (a block dim), at least 1."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def pow2_floor(n: int) -> int:
    """The largest power of two at most n, at least 1."""
    return 1 << max(int(n), 1).bit_length() - 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def warps(elements: int, live: int) -> int:
    """Warps for a program holding `live` fp32 tensors of `elements` values each (whole rows in registers): about
    32 values a thread, 4 to 16 warps (at 16 warps a thread has 128 registers). tests/unit/test_kernels_aot.py
    checks the result with ptxas for sm_80/90/100 at the shipped configs' sizes: no spill."""
    return min(16, max(4, pow2(cdiv(elements * live, 32 * 32))))


def row_warps(row: int, element_size: int) -> int:
    """The most warps that give each thread a 16-byte piece of one row of `row` values: no more for a program that
    sums a [K, row] tile over K. Triton lays a tile's warps along the row first and the rest along K, where a sum
    over K then crosses warps (an exchange through shared memory, and its barriers, every step). The 1B AttnRes
    mix forward at 4 sources a step: 15 barriers on 16 warps, 3 on 8 (64 registers either way, sm_90)."""
    return max(1, row * element_size // (16 * 32))


def programs(n: int, device: torch.device, reduces: bool) -> Tuple[int, int]:
    """(programs, tokens per program). Kernels that reduce parameter gradients over tokens use a few programs per
    SM (fewer partial sums or atomics); the rest one token per program. Under the interpreter a handful of
    programs of several tokens each, so that the tests walk the token loop, its masked tail and the cross-program
    reduction."""
    if _RECORDER is not None:
        count = min(n, 8 * _RECORDER.sm_count) if reduces else n
    elif interpreting() or device.type != "cuda":
        count = min(n, 3)
    elif reduces:
        count = min(n, 8 * gpu_sm_count(device))
    else:
        count = n
    tok = cdiv(n, max(count, 1))
    return cdiv(n, tok), tok


def dot_dim(n: int) -> int:
    """A block dim that a tl.dot multiplies over: the next power of two, at least 16 when compiled (the smallest
    dot tile); under the interpreter as small as the data, so that tests walk several chunks."""
    return max(pow2(n), 1 if interpreting() and _RECORDER is None else 16)


def chunk(c: int, rows: int = 1) -> int:
    """Channels per step of a kernel that walks a row in chunks (a [rows, chunk] tile of about 1k values, so that
    registers do not grow with d); 4 under the interpreter, so that tests walk several chunks and a masked tail."""
    if interpreting():
        return min(pow2(c), 4)
    return min(pow2(c), max(16, 1024 // pow2(rows)))


def sm_count(device: torch.device) -> int:
    """The SMs a launch on `device` fills: the recorder's (the ahead-of-time check's target), a GPU's, else 1."""
    if _RECORDER is not None:
        return _RECORDER.sm_count
    if interpreting() or device.type != "cuda":
        return 1
    return gpu_sm_count(device)


def gpu_sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device, looked up once per device (get_device_properties costs the host microseconds a
    call, and launchers ask at every launch)."""
    return _sm_counts(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _sm_counts(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def current_raw_stream(device: torch.device) -> int:
    """The current CUDA stream of `device` as its handle, without making a torch.cuda.Stream object (what Triton's
    launcher reads too)."""
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device() if device.index is None else device.index)


def reduction_grid(n: int, chunks: int, device: torch.device) -> Tuple[int, int]:
    """(token splits, tokens per split) for a kernel that reduces over tokens with one program per (channel chunk,
    token split): enough programs to fill the GPU (8 per SM), each summing its tokens in registers before it writes
    its split's partial sum (sum_rows) or adds it in (an atomic)."""
    splits = max(1, min(n, (8 * sm_count(device)) // max(chunks, 1)))
    if interpreting() or (device.type != "cuda" and _RECORDER is None):
        splits = min(n, 2)
    tok = cdiv(n, splits)
    return cdiv(n, tok), tok


def partial_sums(programs: int, cols: int, device: torch.device) -> Tensor:
    """A buffer of per-program fp32 partial sums for sum_rows: [programs, cols rounded up to a multiple of 16] (its
    rows then load 16 bytes a thread; the padding columns are never read back)."""
    return torch.empty((programs, partial_width(cols)), dtype=F32, device=device)


def partial_width(cols: int) -> int:
    """The row width of a partial_sums buffer of `cols` columns: a multiple of 16."""
    return cdiv(cols, 16) * 16


def sum_rows(parts: Tensor, cols: Optional[int] = None, scales: Sequence[Tensor] = (),
             dtypes: Optional[Sequence[torch.dtype]] = None, tail: Optional[Tuple[int, int, torch.dtype]] = None):
    """parts [P, K] (a kernel's per-program fp32 partial sums of a parameter gradient) summed over P -> [cols] (the
    first `cols` columns, all by default), by a Triton kernel where the op's kernels run, else by torch. A recorded
    launch, not torch's CPU sum, in the host benchmark: a reduction is the device's work, whose size there follows
    the recorded grid, not the toy widths. A row width K that is a multiple of 16 lets the kernel load 16 bytes a
    thread; it sums whole rows (padding columns past `cols` included) and returns the first `cols`.

    scales: tensors of `cols` values (any float dtype); then the list of the sum times each, made in the same kernel,
    in fp32 and rounded once to `dtypes` (one a scale; fp32 by default). A folded query's gradient is the gradient
    of both its factors, sum * gain and sum * query, in the parameters' dtypes: with 16-bit parameters that was four
    more launches a call (two products, two casts). Without scales, dtypes [dt]: the sum rounded to dt.

    tail (start, tail_cols, dtype): the columns from `start` on are a second gradient's partial sums, which its
    kernel wrote beside the first's in the same rows: their sum, unscaled, its first tail_cols values in dtype, is
    returned after the rest, (result, tail sum), by the same launch (start at or past `cols`, a multiple of 16).
    Phase 2's backward sums its folded query's and its norm weight's gradients so: one launch a sublayer, not two.

    One program per chunk of columns reads a [rows, chunk] tile a step (_sum_rows_blocks): the usual case, the
    1,056 partial rows of a d = 2,048 gradient, is 128 programs of 5 steps. It was 2 programs of 1,056 dependent
    row loads each, then 32 of 17. The order of the sums is fixed by the blocks alone: deterministic."""
    p, k = parts.shape
    cols = k if cols is None else cols
    if len(scales) > 2:
        raise ValueError(f"sum_rows takes at most 2 scales, not {len(scales)}")
    dtypes = list(dtypes) if dtypes is not None else [parts.dtype] * max(1, len(scales))
    if len(dtypes) != max(1, len(scales)):
        raise ValueError(f"sum_rows: {len(scales)} scales but {len(dtypes)} dtypes")
    if tail is not None and not (cols <= tail[0] and tail[0] % 16 == 0 and tail[0] + tail[1] <= k):
        raise ValueError(f"sum_rows: a tail of {tail[1]} columns from {tail[0]} does not fit past {cols} columns "
                         f"of {k} at a multiple of 16")
    if not uses_triton(parts) or not p:
        total = parts.sum(0)
        head = total[:cols]
        if not scales:
            head = head.to(dtypes[0])
        else:
            head = [(head * s.reshape(-1).to(parts.dtype)).to(dt) for s, dt in zip(scales, dtypes)]
        return head if tail is None else (head, total[tail[0]:tail[0] + tail[1]].to(tail[2]))
    # whole rows (a mask at `cols` would break the vectors); an output of its own for each scale (an op's outputs
    # may not alias one another)
    split = k if tail is None else tail[0]
    outs = [torch.empty((split,), dtype=dt, device=parts.device) for dt in dtypes]
    rest = torch.empty((k - split,), dtype=tail[2], device=parts.device) if tail is not None else None
    br, bk = _sum_rows_blocks(p, k, sm_count(parts.device))
    first, second = (list(scales) + [parts, parts])[:2]
    tails = {} if tail is None else {"TAIL": True}  # (the key of a launch without one, as the tuned table has it)
    launch(_sum_rows_kernel, (cdiv(k, bk),),
           (parts, outs[0], outs[-1], outs[0] if rest is None else rest, first, second, p, k, cols, split),
           max(1, br * bk // 1024), BR=br, BK=bk, SCALES=len(scales), **tails)
    head = [out[:cols] for out in outs] if scales else outs[0][:cols]
    return head if tail is None else (head, rest[:tail[1]])


SUM_TILE = 4096  # fp32 values of a sum_rows step: 32 a thread on 4 warps, 16 KiB of loads in flight a program


SUM_ROWS = 256  # the most rows of a sum_rows step


def _sum_rows_blocks(p: int, k: int, sms: int = 0) -> Tuple[int, int]:
    """(rows, columns) of a sum_rows step: up to SUM_ROWS rows (fewer where P is small), and columns to fill
    SUM_TILE, at least 16 (a 16-byte load a thread, a 64-byte piece of each row); down to 32 columns where the
    chunks of K would leave some of the `sms` SMs without a program. A program's steps add into one accumulator, so
    their count is the kernel's latency: the 1B step's usual sum, 1,056 partial rows of 2,048 columns, is 128
    programs of 5 steps of [256, 16] (it was 32 programs of 17 steps of [64, 64], about 11.5 us each on the H200,
    2026-11-30: latency, not its 9 MB); the steps' loads are pipelined (STREAM_STAGES) since 2026-12-07. Under the
    interpreter 2 rows and up to 16 columns, so that the tests walk several steps and masked tails."""
    if interpreting() and _RECORDER is None:
        return min(2, pow2(p)), max(4, min(16, pow2(k)))
    br = min(SUM_ROWS, pow2(p))
    bk = max(16, min(pow2(k), SUM_TILE // br))
    while bk > 32 and cdiv(k, bk) < sms:
        bk //= 2
    return br, bk


TABLES_KEPT = 4096  # pointer tables kept on their devices (a 1B step builds 35-160; each a 512-byte block)
_TABLES: "collections.OrderedDict[tuple, Tensor]" = collections.OrderedDict()  # (place, pointers) -> table


def pointer_table(tensors: Sequence[Tensor], low_bits: Optional[Sequence[bool]] = None) -> Tensor:
    """The data pointers of `tensors` as an int64 tensor on their device: how a kernel reads a set unstacked.

    Built on the host and copied from pinned memory with non_blocking=True, so the host does not wait for the GPU
    (a plain torch.tensor(list, device=cuda) copies from pageable memory, which synchronises the stream: once per
    mixing call, forward, backward and recompute). The caching host allocator keeps the pinned block until the
    copy has run.

    A table is kept, keyed by its pointers (and the stream that copied it), and handed out again for the same
    pointers: a training step allocates its activations in the same order every step, so from the second step on
    a mixing call finds its tables made, without the pinned allocation, the copy and its event on the host. The
    table holds exactly its key, so a hit is right whatever the tensors are now; tables are read, never written.
    While a step is captured as a CUDA graph, a table is a slice of the capture's buffer (kernels/graph_tables.py)."""
    device = tensors[0].device
    # map and reduce run in C: a per-source generator was a Python frame a source (a Full AttnRes step's 7,500)
    pointers = tuple(map(Tensor.data_ptr, tensors))
    if functools.reduce(operator.or_, pointers) & 15:  # the kernels load rows through the table in 16-byte
        # vectors (pointer_at)
        misaligned = [i for i, p in enumerate(pointers) if p % 16]
        raise ValueError(f"pointer_table: tensors {misaligned} do not start on a 16-byte boundary; pass "
                         "contiguous tensors of their own (.contiguous() or .clone())")
    if low_bits is not None:
        pointers = tuple(map(operator.or_, pointers, map(int, low_bits)))
    graph_tables.counted(len(pointers))
    if graph_tables.ACTIVE is not None:  # a step being captured as a CUDA graph: no copy in the graph
        return graph_tables.ACTIVE.take(pointers, device)
    # not while recording (meta tensors, whose pointers are all 0, and the recorded rows ride on the table)
    keyed = _RECORDER is None and device.type in ("cuda", "cpu")
    if keyed:
        place = (device, current_raw_stream(device)) if device.type == "cuda" else (device,)
        key = (place, pointers)
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
            return table
    host = torch.tensor(pointers, dtype=torch.int64, pin_memory=device.type == "cuda")
    table = host if device.type == "cpu" else host.to(device, non_blocking=True)
    if _RECORDER is not None:  # a recorded launch's bytes include the rows behind its tables (launch_bytes)
        table._mega_depth_rows = (list(tensors), [int(b) for b in low_bits or [0] * len(tensors)])
    if keyed:
        _TABLES[key] = table
        if len(_TABLES) > TABLES_KEPT:  # the least recently used goes (a kernel queued on it runs first: the
            # allocator reuses its block only for later work on that stream)
            _TABLES.popitem(last=False)
    return table


def gradient_table(buffers: Sequence[Tensor], adding: Sequence[bool],
                   deferred: Optional[Sequence[bool]] = None) -> Tensor:
    """pointer_table of gradient buffers, with each pointer's low bit set where the kernel adds to the buffer
    instead of storing into it (kernels/grad_sink.py): a buffer already holding other readers' gradients. The
    pointers are 16-byte aligned, so the bit is free; no zero fill and no second table. deferred: bit 1 set where
    the kernel stores no gradient at all (gradient_modes_at; the buffer is a placeholder)."""
    if deferred is None:
        return pointer_table(buffers, adding)
    return pointer_table(buffers, [int(a) | 2 * int(d) for a, d in zip(adding, deferred)])


# --------------------------------------------------------------------------------------------------------------
# Shapes (the autograd glue)
# --------------------------------------------------------------------------------------------------------------


def as_list(sources: Sources) -> List[Tensor]:
    """A stacked [K, *, d] tensor is taken as its K views (no copy), so the ops also replace the references'
    stacked signatures; a sequence must hold tensors of one shape, dtype and device."""
    out = list(sources.unbind(0)) if isinstance(sources, Tensor) else list(sources)
    if not out:
        raise ValueError("at least one source is needed")
    first = out[0]
    for s in out[1:]:
        if s.shape != first.shape or s.dtype != first.dtype or s.device != first.device:
            raise ValueError(f"sources differ: {tuple(s.shape)} {s.dtype} {s.device} vs "
                             f"{tuple(first.shape)} {first.dtype} {first.device}")
    return out


def rows(t: Tensor, d: int) -> Tensor:
    """[*, d] as contiguous token rows [N, d], 16-byte aligned: a view when the layout allows, else a transient
    copy."""
    if t.dim() != 2 or t.shape[1] != d:  # (a reshape costs the host as much as these checks ten times)
        t = t.reshape(-1, d)
    return aligned(t if t.is_contiguous() else t.contiguous())


def source_rows(sources: Sequence[Tensor], d: int) -> List[Tensor]:
    """`rows` of each source, but where the kernels read them through a pointer table (uses_triton) the first alone
    is viewed as [N, d] (the launch's shape): the table needs only the others' pointers, which a contiguous,
    16-byte-aligned tensor has at any shape. A view a source, forward and backward, was a 1B Full AttnRes step's
    2,500 reshapes on the host."""
    first = rows(sources[0], d)
    if not uses_triton(first):
        return [first] + [rows(s, d) for s in sources[1:]]
    rest = sources[1:]
    if all(map(Tensor.is_contiguous, rest)) and not functools.reduce(operator.or_, map(Tensor.data_ptr, rest), 0) & 15:
        return [first, *rest]  # the usual case, checked in C (a Python test a source was 7,800 calls a 1B step)
    return [first] + [s if s.is_contiguous() and not s.data_ptr() % 16 else rows(s, d) for s in rest]


def in_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t.to(dtype), without the call where t has it (the host's time: most op arguments have it already)."""
    return t if t.dtype == dtype else t.to(dtype)


def aligned(t: Tensor) -> Tensor:
    """t, or a copy where it does not start on a 16-byte boundary (a view into a tensor at an odd offset): what a
    pointer table may hold (pointer_table)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def contiguous_each(tensors: Sequence[Tensor]) -> List[Tensor]:
    """[t.contiguous() for t in tensors], with the usual case (all of them are) checked in C."""
    return list(tensors) if all(map(Tensor.is_contiguous, tensors)) else [t.contiguous() for t in tensors]


def depth_weight_is_sigmoid(weight: str) -> bool:
    if weight not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown depth weight {weight!r}; choose softmax or sigmoid")
    return weight == "sigmoid"


def check_heads(d: int, heads: int) -> int:
    if heads < 1 or d % heads:
        raise ValueError(f"hidden size {d} does not split into {heads} heads")
    return int(heads)


def cast_grad(grad: Optional[Tensor], like: Optional[Tensor], needed: bool) -> Optional[Tensor]:
    """A kernel's gradient (often fp32, in rows) as the gradient of `like`: its shape and dtype."""
    if grad is None or like is None or not needed or grad.numel() == 0:
        return None
    if grad.shape != like.shape:
        grad = grad.reshape(like.shape)
    return in_dtype(grad, like.dtype)


def nothing(like: Tensor) -> Tensor:
    """What an op returns where it has no output (an op's schema cannot return None): an empty fp32 tensor."""
    return like.new_empty(0, dtype=F32)


# --------------------------------------------------------------------------------------------------------------
# The twins' numeric helpers (torch)
# --------------------------------------------------------------------------------------------------------------


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (fp64 stays fp64, like the reference's fp32())."""
    return torch.promote_types(dtype, F32)


def folded_query_torch(q: Tensor, g: Optional[Tensor], dtype: torch.dtype, ct: torch.dtype) -> Tensor:
    """gain * query, rounded to the source dtype like the reference's folded query."""
    f = q.to(ct) if g is None else g.to(ct) * q.to(ct)
    return f.to(dtype).to(ct)


def store_or_add_torch(into: Tensor, grad: Tensor, adding: bool) -> None:
    """The twins' store_or_add: a gradient stored into its buffer, or added to what the buffer holds."""
    into.add_(grad) if adding else into.copy_(grad)


def rms_inverse_torch(v: Tensor, eps: float) -> Tensor:
    """1 / RMS over the whole row of v [..., H, C] -> [...]."""
    return torch.rsqrt(v.pow(2).mean((-2, -1)) + eps)


def rms_normed_torch(h: Tensor, w: Tensor, eps: float):
    """rms_normed's twin: rows h [N, d] -> (their RMSNorm in h's dtype, 1 / RMS [N] in the accumulation dtype)."""
    ct = accumulation_dtype(h.dtype)
    hf = h.to(ct)
    rstd = torch.rsqrt(hf.pow(2).mean(-1) + eps)
    return ((hf * rstd[:, None]).to(h.dtype).to(ct) * w.to(ct)).to(h.dtype), rstd


def rms_norm_grad_torch(h: Tensor, dy: Tensor, w: Tensor, rstd: Tensor):
    """rms_norm_grad's twin over all rows: (dh [N, d] in the accumulation dtype, the weight's gradient in its
    dtype)."""
    ct = accumulation_dtype(h.dtype)
    hn = h.to(ct) * rstd.to(ct)[:, None]
    g = dy.to(ct) * w.to(ct)
    dh = rstd.to(ct)[:, None] * (g - hn * (g * hn).mean(-1, keepdim=True))
    return dh, (dy.to(ct) * hn.to(h.dtype).to(ct)).sum(0).to(w.dtype)


# --------------------------------------------------------------------------------------------------------------
# jit helpers shared by the kernels
# --------------------------------------------------------------------------------------------------------------
# A token row of d = H * C channels is held as a [BH, BC] block (head, column): per-head reductions are then plain
# tl.sum calls. Offsets of whole rows are int64 (`token`).


@jit
def token(pid, t, TOK):
    """The int64 row index of the t-th token of program pid."""
    return (pid * TOK + t).to(tl.int64)


@jit
def chunk_block(c0, C, H, BH: tl.constexpr, BCH: tl.constexpr):
    """(channel offsets h * C + c0 + j [BH, BCH], their mask) of the chunk c0 .. c0 + BCH of every head's C
    channels."""
    oh = tl.arange(0, BH)
    oc = c0 + tl.arange(0, BCH)
    return oh[:, None] * C + oc[None, :], (oh < H)[:, None] & (oc < C)[None, :]


@jit
def channel_block(C, H, BH: tl.constexpr, BC: tl.constexpr):
    """(head index [BH], channel offset h * C + c [BH, BC], its mask [BH, BC]) of one token row."""
    oh = tl.arange(0, BH)
    oc = tl.arange(0, BC)
    return oh, oh[:, None] * C + oc[None, :], (oh < H)[:, None] & (oc < C)[None, :]


@jit
def folded_query(q_ptr, g_ptr, offs, mask, like_ptr, NORM: tl.constexpr):
    """gain * query in fp32, rounded to like_ptr's dtype as the reference folds it (NORM: a key-norm gain)."""
    f = tl.load(q_ptr + offs, mask=mask, other=0.).to(tl.float32)
    if NORM:
        f = f * tl.load(g_ptr + offs, mask=mask, other=0.).to(tl.float32)
    return f.to(like_ptr.dtype.element_ty).to(tl.float32)


@jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


# Compiled, sums2/sums3 reduce their tensors together: one exchange of partial sums through shared memory, and its
# barriers, for all of them (each tl.sum takes its own). The interpreter runs a custom combine element by element in
# Python, so there they are plain tl.sum calls: the same sums (a reduction's order is unspecified either way).
FUSED_SUMS = tl.constexpr(not interpreting()) if tl is not None else None


@jit
def sums2(a, b, axis: tl.constexpr):
    """(a.sum(axis), b.sum(axis)) as one reduction (FUSED_SUMS)."""
    if FUSED_SUMS:
        return tl.reduce((a, b), axis, _add2)
    return tl.sum(a, axis=axis), tl.sum(b, axis=axis)


@jit
def sums3(a, b, c, axis: tl.constexpr):
    """(a.sum(axis), b.sum(axis), c.sum(axis)) as one reduction (FUSED_SUMS)."""
    if FUSED_SUMS:
        return tl.reduce((a, b, c), axis, _add3)
    return tl.sum(a, axis=axis), tl.sum(b, axis=axis), tl.sum(c, axis=axis)


@jit
def pointer_at(table, k, like_ptr):
    """The k-th pointer of a pointer table, typed like like_ptr, and known 16-byte aligned (pointer_table checks it):
    without the hint Triton cannot prove the alignment of a loaded pointer and reads bf16 rows 2 bytes at a time."""
    return tl.multiple_of(tl.load(table + k).to(tl.pointer_type(like_ptr.dtype.element_ty)), 16)


@jit
def gradient_at(table, k, like_ptr):
    """(pointer, adding) of the k-th entry of a gradient table (gradient_table): where a source's gradient goes, and
    whether the kernel adds to what is there (the pointer's low bit) or stores."""
    raw = tl.load(table + k)
    adding = (raw & 1) == 1
    return tl.multiple_of((raw - (raw & 1)).to(tl.pointer_type(like_ptr.dtype.element_ty)), 16), adding


@jit
def store_or_add(ptr, value, mask, ADD: tl.constexpr):
    """Store a gradient (an fp32 value) at ptr in ptr's dtype, or add it to what is there (ADD: a gradient sink's
    buffer that already holds other readers' gradients, kernels/grad_sink.py)."""
    if ADD:
        value += tl.load(ptr, mask=mask, other=0.).to(tl.float32)
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


@jit
def pointers_at(table, ok, kmask, like_ptr):
    """The pointers [BK] of a table's first K entries (ok = arange(BK), kmask = ok < K; masked ones are null and
    never read), typed like like_ptr and 16-byte aligned: a [BK, chunk] tile of rows loads in 16-byte vectors."""
    return tl.multiple_of(tl.load(table + ok, mask=kmask, other=0).to(tl.pointer_type(like_ptr.dtype.element_ty)), 16)


@jit
def gradients_at(table, ok, kmask, like_ptr):
    """(pointers [BK], adding [BK]) of a gradient table's entries ok (masked ones null, never written): gradient_at
    for a [BK, chunk] tile of gradient rows, stored or added in 16-byte vectors."""
    raw = tl.load(table + ok, mask=kmask, other=0)
    adding = (raw & 1) == 1
    return tl.multiple_of((raw - (raw & 1)).to(tl.pointer_type(like_ptr.dtype.element_ty)), 16), adding


@jit
def gradient_modes_at(table, ok, kmask, like_ptr):
    """gradients_at, and deferred [BK]: bit 1 of an entry, a source whose gradient is left to its sink (no store;
    gradient_table's `deferred`)."""
    raw = tl.load(table + ok, mask=kmask, other=0)
    low = raw & 3
    return tl.multiple_of((raw - low).to(tl.pointer_type(like_ptr.dtype.element_ty)), 16), (low & 1) == 1, \
        (low & 2) == 2


# Loads in flight in a loop that streams rows and reduces them (a parameter gradient's sum over tokens, sum_rows'
# partial sums, the GRN gates' dots over channels): Triton pipelines a loop's loads into shared memory (cp.async)
# only where the loop asks, `tl.range(..., num_stages=STREAM_STAGES)`; a plain range, or the launch's num_stages,
# leaves a loop with no dot waiting on each step's own loads (compiled for sm_90: no cp.async). 3: two steps' loads
# in flight while one is summed. PAIR_STAGES: one step's loads in flight, where a third stage's buffers cost
# registers (the AttnRes mix backward, the GRN whole-row forward, the stream read's backward). Both 1, no pipelined
# loop, with MEGA_DEPTH_KERNELS_PIPELINE=0 (read at import, as the kernels' constants are): the same kernels with
# each step waiting on its own loads, for a GPU run to time both ways (tools/device_check.sh, kernels_unpipelined).
PIPELINE = os.environ.get("MEGA_DEPTH_KERNELS_PIPELINE", "1") != "0"
STREAM_STAGES = tl.constexpr(3 if PIPELINE else 1) if tl is not None else None
PAIR_STAGES = 2 if PIPELINE else 1  # a launcher's value (its kernels take it as a constexpr argument)
STREAM_PAIR = tl.constexpr(PAIR_STAGES) if tl is not None else None  # the same, for a kernel's own loop

# Whether tl.dot takes bf16/fp16 operands as they are (on the tensor cores: exact products, fp32 sums). Compiled
# it does; the interpreter misreads bf16 in a dot, so there both operands go in as fp32 (the same products).
NATIVE_DOT = tl.constexpr(not interpreting()) if tl is not None else None


@jit
def _sum_rows_kernel(p_ptr, out_ptr, out1_ptr, tail_ptr, s0_ptr, s1_ptr, P, K, COLS, SPLIT, BR: tl.constexpr,
                     BK: tl.constexpr, SCALES: tl.constexpr, TAIL: tl.constexpr = False):
    """out[chunk] = the sum over P rows of p[:, chunk]: a [BR, BK] tile of rows a step, added into a [BR, BK]
    accumulator (lane j sums rows j, j + BR, ...), then the BR lanes reduced once. SCALES 1 or 2: out (and out1) =
    the sum times scale 0's (and 1's) first COLS values (0 past them), rounded to the output's dtype. TAIL: the
    columns from SPLIT on go, unscaled, to tail_ptr (from its start), in its dtype."""
    ok = tl.program_id(0) * BK + tl.arange(0, BK)
    kmask = ok < K
    orow = tl.arange(0, BR)
    acc = tl.zeros([BR, BK], dtype=tl.float32)
    # rows * K: offsets the compiler knows to be multiples of 16 where K is (vector loads); the steps' loads in
    # flight together (STREAM_STAGES): each step only adds its tile, so one at a time left the sum a chain of loads
    for r0 in tl.range(0, P, BR, num_stages=STREAM_STAGES):
        rows = (r0 + orow).to(tl.int64)
        acc += tl.load(p_ptr + rows[:, None] * K + ok[None, :], mask=(rows < P)[:, None] & kmask[None, :], other=0.)
    total = tl.sum(acc, axis=0)
    if TAIL:
        tl.store(tail_ptr + ok - SPLIT, total.to(tail_ptr.dtype.element_ty), mask=kmask & (ok >= SPLIT))
        kmask = kmask & (ok < SPLIT)  # the head's stores
    if SCALES == 0:
        tl.store(out_ptr + ok, total.to(out_ptr.dtype.element_ty), mask=kmask)
    else:
        tl.store(out_ptr + ok, (total * _scale(s0_ptr, orow, ok, COLS)).to(out_ptr.dtype.element_ty), mask=kmask)
        if SCALES == 2:
            tl.store(out1_ptr + ok, (total * _scale(s1_ptr, orow, ok, COLS)).to(out1_ptr.dtype.element_ty),
                     mask=kmask)


@jit
def _scale(s_ptr, orow, ok, COLS):
    """A scale's values at columns ok [BK] (0 past COLS) in fp32. Read as a [BR, BK] tile of one repeated row, whose
    max is the row: a lone [BK] row of 128 bf16 values on 4 warps loaded 2 bytes a thread; the tile loads as the
    partial sums' tile does, 16 bytes a thread, the repeats from L1."""
    tile = tl.load(s_ptr + orow[:, None] * 0 + ok[None, :], mask=(orow >= 0)[:, None] & (ok < COLS)[None, :],
                   other=0.)
    return tl.max(tile.to(tl.float32), axis=0)


@jit
def rms_normed(h, w, D, eps, like_ptr):
    """The host's RMSNorm of a token's whole row h (any shape; Llama's casting, as Liger's "llama" mode and the
    eager norm of megatron/norm.py): h rounded to like_ptr's dtype, normalised in fp32, rounded again, times the
    weight w (fp32, h's shape). -> (y, 1 / RMS). What an op that makes a sublayer input and normalises it in one
    kernel (`Recomputed.normalised`) writes in place of the input."""
    dt = like_ptr.dtype.element_ty
    hr = h.to(dt).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hr * hr) / D + eps)
    return (hr * rstd).to(dt).to(tl.float32) * w, rstd


@jit
def rms_norm_grad(h, dy, w, rstd, D, like_ptr):
    """The backward of rms_normed at h: (dh, this row's term of the weight's gradient). With hn = round(h) * rstd
    and g = dy * w: dh = rstd * (g - hn * mean(g * hn)); dw = dy * round(hn)."""
    dt = like_ptr.dtype.element_ty
    hn = h.to(dt).to(tl.float32) * rstd
    g = dy * w
    mean = tl.sum(g * hn) / D
    return rstd * (g - hn * mean), dy * hn.to(dt).to(tl.float32)


@jit
def dot_t(a, b, acc):
    """acc + a @ b^T in fp32: [M, C] and [N, C] (one dtype; compiled, M, N and C >= 16) -> [M, N]."""
    if NATIVE_DOT:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")


@jit
def dot32(a, b):
    """a @ b in fp32 (weights [M, K] times rows [K, N]) to fp32 accuracy on the tensor cores: three TF32 products
    (tf32x3), not one (TF32 alone keeps 10 mantissa bits)."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")


def _patch_interpreter_index() -> None:
    """TRITON_INTERPRET only: triton 3.6's interpreter turns a scalar into a Python int (`range(K)` over a
    runtime argument) with int() of a 1-element numpy array, which numpy >= 2.3 rejects. Wrap its tensor patch
    so that __index__ takes the element instead. A no-op where numpy still accepts it or the hook is gone."""
    import numpy as np

    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_mega_depth", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._mega_depth = True
    interpreter._patch_lang_tensor = patched


def _patch_interpreter_device_calls() -> None:
    """TRITON_INTERPRET only: triton 3.6's interpreter patches triton.language again at every call of a @jit helper
    inside a kernel (inspect.getmembers over tl, tl.tensor and tl.math, for every program and loop step), though
    the kernel's launch has patched it already: the patch finds no builtin left to replace and its scope is never
    restored. Skip the repeat where every language module the helper sees is patched: the same functions run, and
    the kernel tests take a third less time. The launch's own patch and its restore are untouched."""
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_mega_depth", False) or not hasattr(interpreter, "_LangPatchScope"):
        return

    langs_seen_by = {}  # fn -> the language modules among its globals (its module's, fixed after import)

    def patch_lang(fn):
        langs = langs_seen_by.get(fn)
        if langs is None:
            langs = langs_seen_by[fn] = [v for v in fn.__globals__.values()
                                         if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and not any(tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs):
            return interpreter._LangPatchScope()  # already patched by the launch: nothing to do, nothing to restore
        return original(fn)

    patch_lang._mega_depth = True
    interpreter._patch_lang = patch_lang


if triton is not None and interpreting():
    _patch_interpreter_index()
    _patch_interpreter_device_calls()
