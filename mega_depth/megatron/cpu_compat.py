"""Run megatron-core 0.16.1 on CPU (gloo) for tests and smoke runs. A no-op when CUDA is present.

Megatron-core assumes CUDA in a few places:
- `torch.cuda.current_device()` is used as a device for new tensors (layers, p2p, DDP buffers);
- `torch.cuda.synchronize()` after p2p shape exchanges; `Tensor.cuda()` for the tied output weight under PP;
- the RNG tracker (`tensor_parallel/random.py`) reads and writes `torch.cuda` RNG states; attention always forks it;
- `transformer/utils.py` builds causal masks on "cuda" (also imported by name in `fusions/fused_softmax.py`);
- the schedules, grad clipping and the optimizer allocate small buffers with a literal `device="cuda"` (and RoPE's
  context-parallel chunk index stages through pinned memory);
- the MoE `alltoall` dispatcher copies its split sizes to the host on a side `torch.cuda.Stream` (created in its
  constructor), as numpy arrays (`maybe_move_tensor_to_cpu` converts only CUDA tensors; all-to-all needs ints),
  and waits on an event recorded there;
- `clip_grad_by_total_norm_fp32` asserts that grads are `torch.cuda.FloatTensor`, and the distributed / bf16
  optimizers sort parameters by `param.type()` names of CUDA tensors while they build their groups;
- all-gathers and reduce-scatters with uneven parts (the MoE dispatchers under TP / expert TP) pass lists of
  tensors of different sizes, which NCCL takes and gloo refuses: on gloo they pad to the largest part, or
  all-reduce and keep the rank's part;
- pipeline p2p posts its sends and receives untagged. NCCL's grouped calls pair them, but gloo matches messages
  between two ranks in posting order, so with 2 stages (previous rank == next rank) an interleaved schedule's
  activation can land in the gradient buffer. On gloo, activations and gradients (and their shape messages)
  travel under their own tags.

On a CPU-only torch every one of these raises, so redirecting them to the CPU cannot change a working program:
the `torch.cuda` calls above become their CPU equivalents (the CPU generator stands in for the device generator),
and in the few Megatron modules with `device="cuda"` literals, `torch` is replaced by a proxy that maps that
device to the CPU. Pinned to megatron-core 0.16.1 (pyproject.toml).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch

_APPLIED = False

# Megatron modules that create tensors with a literal device="cuda".
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.data",
    "megatron.core.transformer.utils",
    "megatron.core.utils",  # local_multi_tensor_l2_norm (grad norm without apex)
    "megatron.core.models.common.embeddings.rope_utils",  # context parallelism's RoPE chunk index (pinned)
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like")


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


def _redirect(factory):
    @functools.wraps(factory)
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # a CPU-only torch has no pinned memory; a staging copy needs none here
        return factory(*args, **kwargs)

    return wrapped


class _CpuTorch(types.ModuleType):
    """`torch`, except that tensor factories put "cuda" tensors on the CPU (and `overrides`, e.g. a `cuda`)."""

    def __init__(self, **overrides):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _redirect(getattr(torch, name)))
        for name, value in overrides.items():
            setattr(self, name, value)

    def __getattr__(self, name):
        return getattr(torch, name)


class _CpuCuda(types.ModuleType):
    """`torch.cuda` with one always-current stream."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.Stream = lambda *args, **kwargs: _CPU_STREAM
        self.current_stream = lambda *args, **kwargs: _CPU_STREAM
        self.stream = lambda stream=None: contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def apply() -> bool:
    """Install the shims if CUDA is absent. Idempotent. Returns whether shims are active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it; the CPU generator is seeded there

    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    cpu_torch = _CpuTorch()
    for name in _MODULES_WITH_CUDA_LITERALS:
        importlib.import_module(name).torch = cpu_torch

    # get_default_causal_mask is imported by name elsewhere; rebind those names to the redirected function.
    utils = importlib.import_module("megatron.core.transformer.utils")

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    utils.get_default_causal_mask = get_default_causal_mask
    importlib.import_module("megatron.core.fusions.fused_softmax").get_default_causal_mask = get_default_causal_mask
    # Grad clipping: the same in-place scaling, minus the CUDA type assertion.
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for param in parameters:
                grad = getattr(param, attr, None)
                if grad is not None:
                    clip_grads.to_local_if_dtensor(grad).detach().mul_(clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32 = \
        clip_grad_by_total_norm_fp32
    optim = importlib.import_module("megatron.core.optimizer.optimizer")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    for cls in (distrib.DistributedOptimizer, optim.Float16OptimizerWithFloat16Params):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    _tag_pipeline_p2p()
    _host_split_sizes()
    _uneven_collectives()
    # The MoE dispatcher's side stream: one stream, in that module only (a CPU orders its work already, and "the
    # side stream" is then the current one: no record_stream on CPU tensors; its events are complete when recorded)
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    dispatcher.torch = _CpuTorch(cuda=_CpuCuda())
    _APPLIED = True
    return True


class _CpuEvent:
    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True


class _CpuStream:
    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event or _CpuEvent()

    def synchronize(self):
        return None


_CPU_STREAM = _CpuStream()


def _uneven_collectives() -> None:
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return total.split([int(n) for n in input_split_sizes])[group.rank()].clone()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def _host_split_sizes() -> None:
    """MoE's split sizes "moved to the host" as numpy arrays, as they are on a GPU (here they are there already)."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


_CUDA_TYPE_NAMES = {f"torch.{n}Tensor": f"torch.cuda.{n}Tensor" for n in ("Float", "Half", "BFloat16")}


def _with_cuda_type_names(init):
    """Run `init` while a CPU tensor's `.type()` reports the CUDA name that Megatron's optimizers sort by."""

    @functools.wraps(init)
    def wrapped(*args, **kwargs):
        original = torch.Tensor.type

        def type_name(self, *a, **k):
            out = original(self, *a, **k)
            return _CUDA_TYPE_NAMES.get(out, out) if not a and not k else out

        torch.Tensor.type = type_name
        try:
            return init(*args, **kwargs)
        finally:
            torch.Tensor.type = original

    return wrapped


_TAG_ACTIVATION, _TAG_GRADIENT, _TAG_ACTIVATION_SHAPE, _TAG_GRADIENT_SHAPE = 1, 2, 3, 4


def _tagged_p2p(send_prev, recv_prev, send_next, recv_next, group, prev_rank, next_rank, activation_tag, grad_tag):
    """Megatron's batched p2p with a tag per direction: what goes to `next` is an activation, to `prev` a grad."""
    dist = torch.distributed
    ops = []
    if send_prev is not None:
        ops.append(dist.P2POp(dist.isend, send_prev, prev_rank, group, tag=grad_tag))
    if recv_prev is not None:
        ops.append(dist.P2POp(dist.irecv, recv_prev, prev_rank, group, tag=activation_tag))
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, send_next, next_rank, group, tag=activation_tag))
    if recv_next is not None:
        ops.append(dist.P2POp(dist.irecv, recv_next, next_rank, group, tag=grad_tag))
    return dist.batch_isend_irecv(ops) if ops else []


def _tag_pipeline_p2p() -> None:
    p2p = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication")

    def batched_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                        prev_pipeline_rank, next_pipeline_rank):
        return _tagged_p2p(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                           prev_pipeline_rank, next_pipeline_rank, _TAG_ACTIVATION, _TAG_GRADIENT)

    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        shape = lambda t: None if t is None else torch.tensor(t.size(), dtype=torch.int64)  # noqa: E731
        recv_prev_shape = torch.empty(3, dtype=torch.int64) if recv_prev else None
        recv_next_shape = torch.empty(3, dtype=torch.int64) if recv_next else None
        reqs = _tagged_p2p(shape(tensor_send_prev), recv_prev_shape, shape(tensor_send_next), recv_next_shape,
                           self.pp_group, self.prev_rank, self.next_rank, _TAG_ACTIVATION_SHAPE, _TAG_GRADIENT_SHAPE)
        for req in reqs:
            req.wait()
        as_list = lambda t: [0, 0, 0] if t is None else t.tolist()  # noqa: E731
        return as_list(recv_prev_shape), as_list(recv_next_shape)

    p2p._batched_p2p_ops = batched_p2p_ops
    p2p.P2PCommunicator._communicate_shapes = communicate_shapes
