"""`--cuda-graph-impl local --cuda-graph-scope full_iteration`: a training step's forward and backward captured
once as one CUDA graph and replayed every step after it (Megatron-LM's full-iteration CUDA graph).

A step of the mixing launches several hundred small kernels, and on the GPUs measured the host took as long to
issue them as the device to run them. A replay issues the whole step with one call. The optimizer step, the loss's
read and the NaN policy stay outside the graph, as in Megatron-LM.

How it goes, per backend (one StepGraph each):
- the first `warmup_steps` steps run eagerly (first-call allocations, Triton's compiles, the tables' count);
- the next one copies its micro-batches into static buffers and is captured: the capture records the kernels
  without running them, so the step then replays the graph once, as every later step does;
- a replay copies the step's micro-batches into those buffers first; the losses are the tensors the capture
  returned, which each replay rewrites in place.

What a capture cannot hold is refused when the config is validated (config._check_cuda_graph) or here: a host
sync (the step has none: tools/sync_check.py), a pinned copy (the mixing's pointer tables come from a buffer
filled after the capture: kernels/graph_tables.py), a change of micro-batch shapes or count (a clear error).

Not Megatron's FullCudaGraphWrapper: it keeps one graph per process in class attributes (the benchmarks build a
baseline and a mechanism in one process) and reads the batches from the schedule's iterator itself.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from mega_depth.kernels import graph_tables

Batch = Dict[str, torch.Tensor]
Signature = Tuple[Tuple[Tuple[str, Tuple[int, ...], torch.dtype], ...], ...]


class CudaCapture:
    """One torch.cuda.CUDAGraph: capture(fn) records fn's kernels on `stream` and returns its outputs; replay()
    runs them on the current stream. (The CPU tests give StepGraph a stand-in with the same two methods.)"""

    def __init__(self, stream: "torch.cuda.Stream"):
        self.graph = torch.cuda.CUDAGraph()
        self.stream = stream

    def capture(self, fn: Callable):
        torch.cuda.synchronize()
        previous = torch.cuda.current_stream()
        raised = []  # the step's own error: capture_end's, raised over it, hides it (exc.__context__ may be older)

        def step():
            try:
                return fn()
            except Exception as e:
                raised.append(e)
                raise

        try:
            # thread_local: another thread's CUDA calls (a data loader's pinning) do not break this capture
            with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="thread_local"):
                out = step()
        except Exception as exc:  # one line that names the cause and the way out
            cause = raised[0] if raised else exc
            first = str(cause).splitlines()[0] if str(cause) else ""
            raise RuntimeError(f"the training step could not be captured as a CUDA graph ({type(cause).__name__}: "
                               f"{first}); drop --cuda-graph-impl local to train eagerly, and report the "
                               "mechanism") from exc
        finally:  # a capture that fails at its end leaves its stream current
            torch.cuda.set_stream(previous)
        return out

    def replay(self) -> None:
        self.graph.replay()


@contextlib.contextmanager
def rotary_made_in_the_graph() -> Iterator[None]:
    """Megatron's RotaryEmbedding.forward is an lru_cache (class-wide, 32 entries). Under a capture its cached
    table, made by an eager step, would be read by every replay while only that cache keeps it alive (closing any
    backend clears the cache, and 32 entries evict): the capture computes it instead, so the table is the graph's.
    (A few small kernels a step.)"""
    try:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    except ImportError:  # (megatron-core is always there where a step runs; the stand-in's tests need nothing)
        yield
        return
    cached = RotaryEmbedding.forward
    RotaryEmbedding.forward = cached.__wrapped__
    try:
        yield
    finally:
        RotaryEmbedding.forward = cached


class RerunCapture:
    """The CPU's stand-in for CudaCapture (the tests and tools/graph_check.py's dry run): the capture runs the step
    once (what a real capture's first replay computes), and each later replay runs the same closure again and
    writes its outputs into the captured ones in place, as a graph's replay rewrites its static outputs. A step
    graph that left a step's micro-batches out of the static buffers, or read losses from anywhere but the captured
    tensors, trains on the wrong batches or reports stale losses here as on a GPU."""

    def __init__(self):
        self.fn, self.out, self.fresh, self.reruns = None, None, False, 0

    def capture(self, fn: Callable):
        self.fn, self.out, self.fresh = fn, fn(), True
        return self.out

    def replay(self) -> None:
        if self.fresh:  # the capture's own run stands for the first replay
            self.fresh = False
            return
        new = self.fn()
        self.reruns += 1
        for old, now in zip(torch.utils._pytree.tree_leaves(self.out), torch.utils._pytree.tree_leaves(new)):
            old.copy_(now)


def signature(batches: List[Batch]) -> Signature:
    return tuple(tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(b.items())) for b in batches)


class StepGraph:
    """The captured forward-backward of one model (see the module's docstring)."""

    def __init__(self, warmup_steps: int, device: torch.device, stream: Optional["torch.cuda.Stream"] = None,
                 new_capture: Optional[Callable] = None):
        """stream: where every step runs and the capture is made: the stream the model's DDP was built under
        (megatron backend's build). Autograd accumulates a parameter's gradient on the stream its accumulation
        node was made on, and Megatron's DDP keeps those nodes from its construction: made on the default stream,
        they would make it wait on the capture, which invalidates it (PyTorch's input_buffer warning; Megatron-LM
        builds its DDP on its full-iteration capture stream alike). None: no CUDA (the stand-in's tests)."""
        if warmup_steps < 1:
            raise ValueError("a captured step needs at least one eager warm-up step before it (its compiles and "
                             "its pointer tables' count); set --cuda-graph-warmup-steps >= 1")
        self.warmup_steps = warmup_steps
        self.device = torch.device(device)
        self.stream = stream
        self.new_capture = new_capture or (lambda: CudaCapture(stream))
        self.eager_steps = 0
        self.capture: Optional[object] = None
        self.static: List[Batch] = []
        self.losses = None
        self.tables: Optional[graph_tables.CapturedTables] = None  # kept while the graph lives: it reads them
        self._signature: Optional[Signature] = None
        self._entries = 0  # pointer-table entries the last eager step made

    @property
    def captured(self) -> bool:
        return self.capture is not None

    def step(self, batches: List[Batch], forward_backward: Callable[[List[Batch]], list]) -> list:
        """forward_backward(batches) -> the schedule's losses, eagerly for the warm-up steps, else by the graph."""
        with self._on_stream():
            if self.capture is None and self.eager_steps < self.warmup_steps:
                before = graph_tables.Counter.entries
                losses = forward_backward(batches)
                self._entries = graph_tables.Counter.entries - before
                self.eager_steps += 1
                return losses
            if self.capture is None:
                self._capture(batches, forward_backward)
            else:
                self._load(batches)
            self.capture.replay()
            return self.losses

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """The step on self.stream (warm-up, capture and replays alike), after the current stream's work (the
        last update of the weights, this step's batches) and before what follows on it (the loss's read)."""
        if self.stream is None:
            yield
            return
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def _capture(self, batches: List[Batch], forward_backward: Callable) -> None:
        self._signature = signature(batches)
        self.static = [{k: v.detach().clone() for k, v in b.items()} for b in batches]
        capture = self.new_capture()
        self.tables = graph_tables.CapturedTables(self.device, self._entries)
        with graph_tables.capturing(self.tables), rotary_made_in_the_graph():
            self.losses = capture.capture(lambda: forward_backward(self.static))
        self.tables.fill()
        self.capture = capture

    def _load(self, batches: List[Batch]) -> None:
        if signature(batches) != self._signature:
            raise RuntimeError("the captured step's micro-batches changed shape or number (captured: "
                               f"{_describe(self._signature)}; now: {_describe(signature(batches))}); a CUDA graph "
                               "replays fixed shapes: keep --seq-length and the batch sizes fixed, or run without "
                               "--cuda-graph-impl")
        for static, batch in zip(self.static, batches):
            for k, v in batch.items():
                static[k].copy_(v, non_blocking=True)


def _describe(sig: Optional[Signature]) -> str:
    if not sig:
        return "none"
    return f"{len(sig)} micro-batches of " + ", ".join(f"{k} {list(shape)}" for k, shape, _ in sig[0])
