"""One gradient buffer per source, summed into by the backward kernels of every op that reads it.

A source that many mixes read (Full AttnRes: each sublayer output is read by every later sublayer's mix) gets a
gradient from each of them; autograd adds those one by one, an eager `add` of the whole `[N, d]` tensor per
(source, reader): 1,128 adds, about 110 GB, in a 1B Full AttnRes step. Instead the source is read through an
alias (`aliased`), a view of it whose autograd node (`_Sink`) owns one buffer: the readers' backward kernels
add into that buffer in place and return no gradient for the alias, and the node hands the buffer on as the
source's gradient. The engine runs the node only after every reader's backward (each of them is an edge into it),
so the buffer is complete when it is handed on; a reader whose output does not reach the loss never runs and
adds nothing, as autograd would.

    sources = aliased(sources)                    # in the op's wrapper, eager and with grad enabled
    ctx.sinks = sinks_of(sources)                 # in setup_context: one per source, or None
    into, adding = buffers(ctx.sinks, sources)    # in backward: where the kernel stores (or adds) each gradient
    ... the op's backward kernels, into `into` ...
    return returned(ctx.sinks, into, needed), ...    # autograd gets the gradients of sources without a sink

A recomputed region (activation checkpointing's nested backward) reads detached copies of its inputs: `share`
gives each copy its source's sink, and `for_the_caller` lets the nested pass fill the buffers of the pass that
runs it, so readers in every region of every layer add into the same buffer.

Eager only: under torch.compile the op stays one node and autograd adds as before.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from mega_depth.model import base as model_base

_SINK = "_mega_depth_grad_sink"  # attribute of an alias (and of a recomputed region's copy): its sink
_COMPANION = "_mega_depth_grad_sink_companion"  # attribute of a companion's alias: (its sink, its index)
# id(source) -> (the source, its alias), both weakly: an attribute on the source would hold the alias, which holds
# the source as its view base in C++, a cycle the garbage collector cannot see (every step's activations would stay
# alive). The readers' saved tensors keep the alias alive while a later reader may still look it up; the source's
# own reference tells a reused id from the same tensor (a view's `_base` is the root of its chain, not the source).
_ALIASES: Dict[int, Tuple[weakref.ref, weakref.ref]] = {}


_CALLERS: List[int] = []  # graph tasks whose nested backward passes run now (for_the_caller)


def task() -> int:
    """The backward pass that buffers belong to: the current one, or the one running a nested recomputation."""
    return _CALLERS[-1] if _CALLERS else torch._C._current_graph_task_id()


@contextlib.contextmanager
def for_the_caller() -> Iterator[None]:
    """Around a nested backward pass run from a Function's backward (a recomputed region): readers in it add into
    the buffers of the pass that runs the Function."""
    _CALLERS.append(task())
    try:
        yield
    finally:
        _CALLERS.pop()


def share(copy: Tensor, source: Tensor) -> Tensor:
    """A recomputed region's detached copy of `source` takes its sink (the region's readers add into it)."""
    sink = getattr(source, _SINK, None)
    if sink is not None:
        setattr(copy, _SINK, sink)
    return copy


class Sink:
    """The gradient buffer of one source, and the records of its deferred readers, for the backward pass (graph
    task) that is filling them."""

    def __init__(self):
        self.buffer: Optional[Tensor] = None
        self.deferred: Dict[tuple, list] = {}  # resolver key -> its readers' records
        self.task = -1
        self.readers = 0  # the ops that read the source through its alias in forward (`aliased`)

    def _drop_stale(self, now: Optional[int] = None) -> None:
        """What another pass left (one that did not reach the source, e.g. torch.autograd.grad for a later
        parameter alone) is dropped, never added to. now: task(), where the caller has it."""
        now = task() if now is None else now
        if self.task != now:
            self.buffer, self.deferred, self.task = None, {}, now

    def current(self) -> Optional[Tensor]:
        """The buffer of this backward pass."""
        self._drop_stale()
        return self.buffer

    def hold(self, buffer: Tensor) -> None:
        self._drop_stale()
        self.buffer = buffer

    def defer(self, key: tuple, record: tuple) -> None:
        """A reader leaves its part of the source's gradient to the sink: key = (resolve, *settings), and the sink's
        node calls resolve(source, records, held, *settings) once with every record of that key (held: the buffer
        so far, or None), which returns the buffer with all of them added (or (buffer, {i: gradient}): the
        gradients it made of the sink's companions, `aliased_with`). A reader whose records are summed together
        reads each reader's output gradient once, where adding in turn reads and writes the buffer each time
        (kernels/attnres_mix.py: Full AttnRes's source gradients)."""
        self._drop_stale()
        # a record keeps its reader's output gradient until the sum: autograd hands that tensor to this reader alone
        # and nothing writes it after (a reader that got a tensor others share would have to copy it first)
        self.deferred.setdefault(key, []).append(record)

    def take(self) -> Tuple[Optional[Tensor], Dict[tuple, list]]:
        self._drop_stale()
        taken = self.buffer, self.deferred
        self.buffer, self.deferred = None, {}
        return taken


def defer_each(sinks: Sequence[Optional[Sink]], flags: Sequence[bool], key: tuple, records: Iterable[tuple]) -> None:
    """Sink.defer(key, record) for each sink whose flag is set, with its record (one reader's backward: Full
    AttnRes's mix leaves up to 48 sources' parts at once). The pass is looked up once, not once a source: Sink.defer
    a source was six calls, 1,219 times a 1B step."""
    now = task()
    for sink, flag, record in zip(sinks, flags, records):
        if flag:
            if sink.task != now:
                sink._drop_stale(now)
            sink.deferred.setdefault(key, []).append(record)


class _Sink(torch.autograd.Function):
    """Identity in forward; in backward the sink's buffer, its deferred readers' parts summed in, plus the gradient
    of any reader that returned one. Companions (`aliased_with`) pass through the same node: their gradients are
    what the resolvers made of them plus what their readers returned."""

    @staticmethod
    def forward(ctx, source: Tensor, sink: Sink, *companions: Tensor):
        ctx.sink = sink
        # for the deferred readers' resolvers: a detached reference (the readers keep the tensor too), not a saved
        # tensor, which a first backward without retain_graph would free under a second graph that shares the alias
        ctx.source = source.detach()
        ctx.set_materialize_grads(False)  # readers return None: no zero tensor for them
        if not companions:
            return source.view_as(source)
        return (source.view_as(source), *(c.view_as(c) for c in companions))

    @staticmethod
    def backward(ctx, grad: Optional[Tensor], *companion_grads: Optional[Tensor]):
        buffer, deferred = ctx.sink.take()
        made: Dict[int, Tensor] = {}
        for (resolve, *settings), records in deferred.items():
            out = resolve(ctx.source, records, buffer, *settings)
            buffer, more = out if isinstance(out, tuple) else (out, {})
            made.update(more)
        if buffer is not None and grad is not None:
            buffer = buffer.add_(grad)
        companions = [_added(made.get(i), g) for i, g in enumerate(companion_grads)]
        return (grad if buffer is None else buffer), None, *companions


def _added(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    return b if a is None else a if b is None else a + b


def aliased(sources: Sequence[Tensor]) -> List[Tensor]:
    """Each source that requires grad as its alias (made on first use, then the same for every reader; each call
    counts as one reader of each, for as long as the alias lives: two forward passes over the same source, both
    graphs kept, count the readers of both). Returns the sources unchanged where grad is off, or where one tensor appears twice
    (its two gradients would race)."""
    if not torch.is_grad_enabled() or len(set(map(id, sources))) < len(sources):
        return list(sources)
    out = []
    for s in sources:
        if not s.requires_grad:  # (a leaf frozen after an earlier reader aliased it: read as itself)
            out.append(s)
            continue
        # the alias that an earlier reader made, looked up here (Full AttnRes: 1,225 lookups a 1B step, 49 makes)
        refs = _ALIASES.get(id(s))
        alias = refs[1]() if refs is not None and refs[0]() is s else None
        if alias is None:
            if hasattr(s, _SINK):
                out.append(s)
                continue
            alias = _alias_of(s)[0]
        getattr(alias, _SINK).readers += 1
        out.append(alias)
    return out


def aliased_with(source: Tensor, companions: Sequence[Tensor]) -> Tuple[Tensor, List[Tensor]]:
    """(aliased([source])[0], the companions): where this call makes the source's alias, the companions (tensors
    whose gradients the sink's resolvers may make, `companion_of`: mHC's phi, whose gradient the streams' sum
    computes in its pass over the streams) go through the same node, as aliases of their own; where the source
    already has its alias (another reader made it), or grad is off, they come back as they are."""
    if not (torch.is_grad_enabled() and source.requires_grad) or hasattr(source, _SINK):
        return source, list(companions)
    alias, made = _alias_of(source, companions)
    getattr(alias, _SINK).readers += 1
    return alias, list(companions) if made is None else made


def companion_of(t: Tensor, sinks: Optional[Sequence[Optional[Sink]]]) -> Optional[int]:
    """The index of t among the companions of the first of `sinks` (`aliased_with`), or None: a reader that defers
    its part to that sink may leave t's gradient to the sink's resolver too."""
    companion = getattr(t, _COMPANION, None)
    if companion is None or not sinks or companion[0] is not sinks[0]:
        return None
    return companion[1]


def deferring(sinks: Optional[Sequence[Optional[Sink]]], least: Optional[int] = None) -> Optional[List[bool]]:
    """For a reader that can defer: which of its sources' gradients to leave to their sinks (those that `least`
    or more ops read, where that pays; by default DEFER_READERS: model/base.py), or None where it defers none."""
    if sinks is None:
        return None
    least = model_base.DEFER_READERS if least is None else least  # (read at the call: a test may lower it)
    flags = [sink is not None and sink.readers >= least for sink in sinks]
    return flags if any(flags) else None


def _alias_of(source: Tensor, companions: Sequence[Tensor] = ()) -> Tuple[Tensor, Optional[List[Tensor]]]:
    """(the source's alias, its companions' aliases where this call made it, else None)."""
    key = id(source)
    refs = _ALIASES.get(key)
    alias = refs[1]() if refs is not None and refs[0]() is source else None
    if alias is not None:
        return alias, None
    # none yet, or an id reused by a new tensor
    sink = Sink()
    out = _Sink.apply(source, sink, *companions)
    alias, made = (out, []) if not companions else (out[0], list(out[1:]))
    setattr(alias, _SINK, sink)
    for i, c in enumerate(made):
        setattr(c, _COMPANION, (sink, i))
    _ALIASES[key] = (weakref.ref(source), weakref.ref(alias, lambda ref, key=key: _forget(key, ref)))
    return alias, made


def _forget(key: int, alias_ref: weakref.ref) -> None:
    """The alias died (its readers' graphs are gone): drop its entry, unless a newer alias took the id."""
    entry = _ALIASES.get(key)
    if entry is not None and entry[1] is alias_ref:
        del _ALIASES[key]


def sinks_of(sources: Sequence[Tensor]) -> Optional[List[Optional[Sink]]]:
    """The sink of each source (None where it has none); None where no source has one."""
    sinks = list(map(getattr, sources, itertools.repeat(_SINK), itertools.repeat(None)))  # (in C: a source a
    # call, up to 49)
    return sinks if any(map(operator.is_not, sinks, itertools.repeat(None))) else None


def buffers(sinks: Sequence[Optional[Sink]], sources: Sequence[Tensor],
            deferred: Optional[Sequence[bool]] = None) -> Tuple[List[Tensor], List[bool]]:
    """(where the backward kernel puts each source's gradient, whether it adds to what is there: a sink that already
    holds other readers' gradients). The other buffers are new and empty, the kernel stores into them; a source
    without a sink gets one of its own (its gradient is returned to autograd as before). A `deferred` source gets
    an empty placeholder: its reader leaves its gradient to the sink (Sink.defer)."""
    out, adding = [], []
    placeholder = None
    for i, (sink, src) in enumerate(zip(sinks, sources)):
        if deferred is not None and deferred[i]:
            placeholder = src.new_empty(0) if placeholder is None else placeholder  # one a call (host time)
            out.append(placeholder)
            adding.append(False)
            continue
        held = sink.current() if sink is not None else None
        adding.append(held is not None)
        if held is None:
            held = torch.empty_like(src, memory_format=torch.contiguous_format)
            if sink is not None:
                sink.hold(held)
        out.append(held)
    return out, adding


def returned(sinks: Sequence[Optional[Sink]], into: Sequence[Tensor], needed: bool) -> List[Optional[Tensor]]:
    """The source gradients that go to autograd: None for a source with a sink (its node hands the buffer on)."""
    return [None if sink is not None or not needed else g for sink, g in zip(sinks, into)]


# --------------------------------------------------------------------------------------------------------------
# Activation checkpointing that keeps the sinks
# --------------------------------------------------------------------------------------------------------------


def recompute(fn, *tensors: Optional[Tensor]):
    """model/base.recompute (reentrant activation checkpointing: keep `tensors`, run fn again in backward) with the
    sinks kept: the inputs are read through their aliases, the re-run reads copies that share those sinks, and its
    nested backward adds into the buffers of the pass that runs it. A source that recomputed regions and other
    readers both read (HC / mHC's streams: the coefficients and the sublayer input are recomputed, the stream write
    is not) then gets one buffer, not one gradient per region for autograd to add. The base form where nothing
    needs a gradient, or where the call is traced (a compiled layer)."""
    from mega_depth.kernels.eager import traced
    from mega_depth.model.base import recompute as base_recompute

    present = [t for t in tensors if t is not None]
    if (not torch.is_grad_enabled() or torch.compiler.is_compiling() or traced(present)
            or not any(t.requires_grad for t in present)):
        return base_recompute(fn, *tensors)
    aliases = iter(aliased(present))
    return _Recompute.apply(fn, *(None if t is None else next(aliases) for t in tensors))


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn = fn
        ctx.autocast = [(device, torch.get_autocast_dtype(device)) for device in ("cuda", "cpu")
                        if torch.is_autocast_enabled(device)]
        ctx.set_materialize_grads(False)  # an output that does not reach the loss: no zero gradient to run back
        ctx.save_for_backward(*tensors)
        return fn(*tensors)

    @staticmethod
    def backward(ctx, *grads):
        copies = [None if t is None else share(t.detach().requires_grad_(t.requires_grad), t)
                  for t in ctx.saved_tensors]
        with torch.enable_grad(), contextlib.ExitStack() as stack:
            for device, dtype in ctx.autocast:  # the forward's autocast, as torch.utils.checkpoint restores it
                stack.enter_context(torch.autocast(device, dtype))
            outputs = ctx.fn(*copies)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            with for_the_caller():
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *(None if c is None else c.grad for c in copies))


# --------------------------------------------------------------------------------------------------------------
# One buffer for the slices of a tensor that each reader reads one of
# --------------------------------------------------------------------------------------------------------------

_SLICE = "_mega_depth_grad_slice"  # attribute of an unbound slice: (its Slices, its index)


class Slices:
    """The gradient buffer [S, *] of a tensor whose S slices are read by one reader each (Block AttnRes's phase-1
    outputs, each read by one sublayer's phase 2). unbind's backward stacks the S slice gradients into a new
    tensor, a copy of all of them; here a reader's backward kernel writes its slice's gradient into its slot of one
    buffer (`slot`), and the buffer is the tensor's gradient."""

    def __init__(self, like: Tensor):
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self.buffer: Optional[Tensor] = None
        self.written: set = set()
        self.task = -1

    def _drop_stale(self) -> None:
        """A buffer left from another backward pass (as `Sink.current`) is dropped, never written into."""
        if self.buffer is not None and self.task != task():
            self.buffer, self.written = None, set()

    def slot(self, index: int) -> Tensor:
        """Where slice `index`'s reader writes its gradient (whole: it is the slice's only reader)."""
        self._drop_stale()
        if self.buffer is None:
            self.buffer, self.task = torch.empty(self.shape, dtype=self.dtype, device=self.device), task()
        self.written.add(index)
        return self.buffer[index]

    def take(self) -> Tuple[Optional[Tensor], set]:
        self._drop_stale()
        taken = self.buffer, self.written
        self.buffer, self.written = None, set()
        return taken


class _Unbound(torch.autograd.Function):
    """t.unbind(0) in forward; in backward the slices' buffer, with what readers returned to autograd instead of
    writing their slot added in, and zeros in the slots no reader reached."""

    @staticmethod
    def forward(ctx, t: Tensor, slices: Slices):
        ctx.slices = slices
        ctx.set_materialize_grads(False)
        return t.unbind(0)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        buffer, written = ctx.slices.take()
        if buffer is None:
            if all(g is None for g in grads):
                return None, None
            buffer = torch.empty(ctx.slices.shape, dtype=ctx.slices.dtype, device=ctx.slices.device)
        for i, (slot, g) in enumerate(zip(buffer.unbind(0), grads)):
            if g is not None and i in written:  # a reader that returned its gradient beside one that wrote
                slot.add_(g)
            elif g is not None:
                slot.copy_(g)
            elif i not in written:
                slot.zero_()
        return buffer, None


def unbound(t: Tensor) -> List[Tensor]:
    """t.unbind(0), each slice tagged with its slot in one gradient buffer for the whole of t (`Slices`; `slot_of`):
    eager and with grad enabled, else plain unbind."""
    if not (torch.is_grad_enabled() and t.requires_grad) or torch.compiler.is_compiling():
        return list(t.unbind(0))
    slices = Slices(t)
    out = list(_Unbound.apply(t, slices))
    for i, s in enumerate(out):
        setattr(s, _SLICE, (slices, i))
    return out


def slot_of(t: Tensor) -> Optional[Tuple[Slices, int]]:
    """(the Slices, the index) of an `unbound` slice, or None."""
    return getattr(t, _SLICE, None)
