"""The Mechanism interface: everything one depth-mixing method owns, in one place.

A mechanism (one file beside this one, registered in registry.py) holds
- its config fields (`options`) and their validation (`validate`);
- its parameters (`layer_modules`, `final_modules`), their names (`module_names`: init, weight decay, state-dict
  mapping and checkpoints ask `owns`/`decays`), and its named settings for tools and configs (`catalogue`);
- how a sublayer's input is formed and its output recorded (`layer_forward` / `run_layers`, on a host layer);
- its cross-layer state and the pipeline payload (`initial_state`, `layout`, `entries`, `state_from`);
- the depth weights it draws in heatmaps (`self.recorder`), and the fields an exported config carries.

Hosts (the `Host` protocol below). The Megatron-core layer (megatron/layer.py), the plain decoder's layer
(decoder.py) and the ahead-of-time check's stand-in (kernels/aot.py) all offer:
    layer_index                                   0-based global layer number
    attention_sublayer(x, k_in=None, v_in=None, value_mixer=None) -> [*, d]
        pre-norm (applied to each input) + attention (+ hidden dropout); x may be a `Recomputed` input (the norm
        then keeps only its sources for backward, see `normed`); DCA passes separate key/value inputs;
        value_mixer(raw_query, raw_key, value, query_norm, key_norm) -> (query, key, value): Depth-Attention's
        mixer takes the projections before the q/k norms and returns the normalised query and key with the mixed
        values; the host's attention uses them as they are (each norm runs once, in the mixer)
    attention_sublayer_recomputed(make_inputs, sources, remakes=False) -> (out [*, d], q_in)
        the same on (q_in, k_in, v_in) = make_inputs(*sources) (stacked [3, *, d]), where the Megatron host keeps
        neither those inputs nor their normalised forms for backward but recomputes them from `sources` (DCA's fast
        path); remakes: make_inputs' autograd node keeps only the sources (as a `Recomputed`'s)
    mlp_sublayer(x) -> [*, d]                     pre-norm + MLP (+ hidden dropout); x may be `Recomputed`
    <module name>                                 the mechanism's own modules, as attributes
and the decoder / last pipeline stage offers the final modules as attributes. Mechanisms never see Megatron,
process groups or devices: the same code runs in the training model, the Hugging Face export and the XLA path.

This file is copied into exported Hugging Face folders: it imports nothing of mega_depth outside this folder.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch
from torch import Tensor, nn


@runtime_checkable
class Host(Protocol):
    """What a mechanism runs one layer on (the module docstring says what each member does). A new attention hook
    is a new keyword here; tests/unit/test_backend_protocol.py holds every host to these signatures."""

    layer_index: int

    def attention_sublayer(self, x, k_in=None, v_in=None, value_mixer=None) -> Tensor: ...

    def attention_sublayer_recomputed(self, make_inputs, sources, remakes=False) -> Tuple[Tensor, Tensor]: ...

    def mlp_sublayer(self, x) -> Tensor: ...


@dataclass(frozen=True)
class Option:
    """A config field of a mechanism: `--name-with-dashes` on the command line, `residual.<name>` in YAML."""

    name: str
    type: type  # int | float | str | bool; a None default makes it Optional
    default: Any
    help: str
    choices: Optional[Tuple[Any, ...]] = None
    # What a saved config (checkpoint, export) that does not record the option meant, where that differs from the
    # default: an option whose default changed, so an older model loads as it was trained.
    unrecorded: Any = None


@dataclass(frozen=True)
class Entry:
    """One named piece of a mechanism's cross-layer state in the pipeline payload."""

    name: str
    width: int  # elements per (token, sample) in the packed [s, b, width] tensor
    immutable: bool  # never changes once made: virtual stages may cache it on the rank instead of resending it


NORM_EPSILON = 1e-6  # RMSNorm's epsilon unless configured (Llama / Qwen3's): the one default


@dataclass(frozen=True)
class ModelShape:
    """What a mechanism needs to know about the decoder around it."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    norm_epsilon: float
    qk_norm: bool = True  # the attention normalises its query and key per head (Qwen3's q/k norms)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_sublayers(self) -> int:
        return 2 * self.num_layers


STATS = " stats"  # a Recorder figure of [entropy, logit spread] per reader: scalars, not a heatmap
TOKEN_SPREAD = " token spread"  # a Recorder figure of the std over tokens of each source's weight
STAT_NAMES = ("entropy", "logit_std")


class Recorder:
    """Mean depth weights of one forward pass, for heatmaps: {figure: {(order, label): weights}}.

    A mechanism records only while `mechanism.recorder` is set (a probe forward). `add` keeps [K] weights per row
    (averaged over every dim but the first: tokens, samples, heads, channels); `add_matrix` keeps an [n, n] map per
    row (a stream mix: averaged over every dim but the first two), drawn as one small grid per row.

    The reductions stay on the device until `figures` is read, which copies them all to the host at once: a read
    per row would sync a GPU once per row and, on XLA, compile a graph of the forward so far for each."""

    def __init__(self):
        self._rows: List[Tuple[str, Tuple[float, str], Tensor]] = []  # (figure, (order, label), reduced weights)
        self._figures: Dict[str, Dict[Tuple[float, str], list]] = {}

    def add(self, figure: str, order: float, label: str, weights: Tensor, softmax: bool = False) -> None:
        """softmax: the weights are a softmax over sources per token; then also record, per reader, the mean
        entropy and logit spread (the std over sources of log w: the logits' own, as a softmax is shift-invariant)
        as figure + STATS, and the std over tokens of each source's weight as figure + TOKEN_SPREAD."""
        w = weights.detach().float().flatten(1) if weights.dim() > 1 else weights.detach().float()
        self._rows.append((figure, (order, label), w.mean(1) if w.dim() > 1 else w))
        if softmax and w.dim() > 1:
            log_w = w.clamp_min(1e-30).log()
            entropy = -(w * log_w).sum(0).mean()
            self._rows.append((figure + STATS, (order, label),
                               torch.stack([entropy, log_w.std(0, unbiased=False).mean()])))
            self._rows.append((figure + TOKEN_SPREAD, (order, label), w.std(1, unbiased=False)))

    def add_matrix(self, figure: str, order: float, label: str, weights: Tensor) -> None:
        """weights [n_out, n_in, *]: entry (i, j) is what stream j gives to stream i."""
        self._rows.append((figure, (order, label), weights.detach().float().flatten(2).mean(2)))

    @property
    def figures(self) -> Dict[str, Dict[Tuple[float, str], list]]:
        if self._rows:
            host = torch.cat([t.reshape(-1) for _, _, t in self._rows]).cpu()  # the one device-to-host copy
            start = 0
            for figure, key, t in self._rows:
                self._figures.setdefault(figure, {})[key] = host[start:start + t.numel()].view(t.shape).tolist()
                start += t.numel()
            self._rows = []
        return self._figures


def recompute(fn: Callable, *tensors: Optional[Tensor]):
    """fn(*tensors), keeping only `tensors` for backward and running fn again there: reentrant activation
    checkpointing, whose inputs are saved with save_for_backward (so saved-tensor accounting sees them); inside a
    compiled layer the non-reentrant form. Parameters that fn uses get their gradients in that backward re-run.
    Plain fn(*tensors) where no input needs a gradient."""
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors):
        return fn(*tensors)
    from torch.utils.checkpoint import checkpoint

    # Inside a compiled layer Dynamo traces the non-reentrant form (a higher-order op whose region AOTAutograd
    # recomputes in backward); the reentrant form would break the graph.
    reentrant = not torch.compiler.is_compiling()
    return checkpoint(fn, *tensors, use_reentrant=reentrant, preserve_rng_state=False)


@dataclass(frozen=True)
class Recomputed:
    """A sublayer input that a mechanism's fast path hands to the host instead of a tensor: make(*sources). The
    host's pre-norm then keeps only the sources for backward, not the input itself (checkpointed aggregation)."""

    make: Callable[..., Tensor]
    sources: Tuple[Optional[Tensor], ...]
    recompute: Callable[..., Any] = recompute  # the checkpoint (Mechanism.recompute: the fast path's keeps sinks)
    # make's autograd node keeps only its inputs (the fused ops'): a host norm with a `remade` form may then run make
    # once with autograd and make the input again in its own backward instead of checkpointing the region
    remakes: bool = False
    # normalised(weight, eps, *sources): the host's RMSNorm of make(*sources) in one op, where the mechanism's fast
    # path has one; a host norm that runs the same norm may call it instead (the input is then never written)
    normalised: Optional[Callable[..., Tensor]] = None


def normed(norm: Callable[[Tensor], Tensor], x) -> Tensor:
    """A host's pre-norm of a sublayer input: a tensor, or a `Recomputed` one (recomputed in backward: by the norm
    itself where it can make its input again, `norm.remade(make, sources, normalised)`, which may run the
    mechanism's op that makes and normalises it in one, else by checkpointing the region)."""
    if isinstance(x, Recomputed):
        remade = getattr(norm, "remade", None) if x.remakes else None
        out = remade(x.make, x.sources, x.normalised) if remade is not None else None
        if out is not None:
            return out
        return x.recompute(lambda *sources: norm(x.make(*sources)), *x.sources)
    return norm(x)


def norm_outputs_made_again(norms: Sequence[Callable], like: Tensor):
    """The host norms' context in which what their outputs' readers save for backward is made again from the norms'
    inputs instead of kept (`norm.outputs_made_again(like)`, one for all of them), or None where a norm cannot (the
    caller checkpoints the region instead)."""
    makers = {getattr(norm, "outputs_made_again", None) for norm in norms}
    maker = makers.pop() if len(makers) == 1 else None
    return maker(like) if maker is not None else None


def sunk_gradients(readers: Dict[Any, int], width: Callable[[Any], float] = lambda source: 1.0) -> float:
    """The traffic of the source gradients that backward kernels sum in one buffer per source (kernels/grad_sink.py):
    the first reader stores its gradient, each other reads the buffer and writes it back. readers: source -> how many
    kernels read it; width(source): its size in [tokens, d] units."""
    return sum(width(source) * (2 * count - 1) for source, count in readers.items() if count)


# A source whose gradient at least this many readers sum has it summed by its sink at once, where its readers can
# leave their parts to it (kernels/grad_sink.py, Sink.defer): adding in turn reads and writes its buffer once a
# reader (3R - 1 rows for R readers: read the source, read and write the buffer); summed at once, each reader reads
# the source and leaves a few coefficients a token, and the sink reads each reader's output gradient, the source, and
# writes the gradient once (2R + 2). Fewer bytes from 3 readers, but off (never) by default: on the H200 of
# 2026-12-04, 4 mixes over 25 sources took 17.6 ms backward with it (12 % of copy bandwidth), where one mix storing
# its 25 gradients took 0.74 ms, and Full AttnRes's 1B step ran at 2.22x the baseline's (1.44x on 2026-11-30).
# tools/bench_kernels.py times both (attnres_mix_shared, attnres_mix_deferred); 4 is where the bytes say it pays.
DEFER_READERS: float = math.inf


def summed_gradients(readers: Dict[Any, int], per_reader: float = 0.0, reads_source: bool = True) -> float:
    """The traffic of the source gradients of readers that leave their parts to the sinks (Sink.defer): sources with
    DEFER_READERS or more readers are summed at once (each reader's output gradient read, the source read where
    `reads_source`, the gradient written; per_reader: more a reader, its coefficients), the others as in
    sunk_gradients."""
    deferred = {s: r for s, r in readers.items() if r >= DEFER_READERS}
    summed = sum(r * (1 + per_reader) + 1 + int(reads_source) for r in deferred.values())
    return summed + sunk_gradients({s: r for s, r in readers.items() if s not in deferred})


def sublayer_label(sublayer: int, num_sublayers: int) -> Tuple[float, str]:
    """Heatmap row of sublayer 1..L, and of L+1: the output aggregation (the final norm's input)."""
    if sublayer > num_sublayers:
        return float(sublayer), "output (final norm)"
    layer, kind = (sublayer - 1) // 2, ("attn", "mlp")[(sublayer - 1) % 2]
    return float(sublayer), f"sublayer {sublayer} ({kind} {layer})"


class Mechanism:
    """Base class. Subclasses set `name`, `options`, `module_names` and implement the forward and payload."""

    name: ClassVar[str]
    options: ClassVar[Tuple[Option, ...]] = ()
    # Options of other mechanisms this one also reads (e.g. mHC reads HC's --hc-expansion).
    shared_options: ClassVar[Tuple[str, ...]] = ()
    # Child modules it adds to layers and to the decoder end: their parameters are the mechanism's.
    module_names: ClassVar[Tuple[str, ...]] = ()
    # Whether it uses the generic depth-mixing layer at all (standard: Megatron's own layer, unmodified).
    mixes_depth: ClassVar[bool] = True
    # Whether the sublayers' outputs still join the stream by plain eager adds (the standard residual's x + f(x);
    # DCA's a + q_in and a + m), which its kernels do not replace (training_io_units).
    plain_residual_adds: ClassVar[bool] = False
    # False where attention gets separate query/key/value inputs (DCA): Transformer Engine's fused norm+QKV
    # projection cannot take them, so such a mechanism runs on the local spec.
    runs_on_fused_norm_qkv: ClassVar[bool] = True

    def __init__(self, residual, shape: ModelShape, tp: int = 1, sp: bool = False):
        self.residual = residual  # the ResidualConfig (mechanism fields are read from it by name)
        self.shape = shape
        self.tp, self.sp = tp, sp
        self.recorder: Optional[Recorder] = None
        self.kernels = None  # a fast-path namespace (mega_depth.kernels) or None: the eager math
        self.recompute_mixing = True  # with a fast path: see `recomputes`
        self.compiled_layer_forward: Optional[Callable] = None  # --compile-layers: torch.compile(layer_forward)

    # --- config -------------------------------------------------------------------------------------------------
    @classmethod
    def catalogue(cls, num_layers: int) -> Dict[str, Dict[str, Any]]:
        """Named settings {catalogue name: ResidualConfig fields} for a model of `num_layers` layers."""
        return {}

    @classmethod
    def validate(cls, cfg, fail) -> None:
        """Refuse settings that cannot work: fail(condition, message naming the fix). `cfg` is the training
        config (cfg.model, cfg.residual, cfg.parallel)."""

    def inference_form(self) -> str:
        """How decoding computes the mixing (an exported config records it)."""
        return "layer by layer, per token; the KV cache has the standard layout"

    def option_values(self) -> Dict[str, Any]:
        """This mechanism's settings (what a checkpoint must match and an exported config carries)."""
        names = [o.name for o in self.options] + list(self.shared_options)
        return {n: getattr(self.residual, n) for n in names}

    # --- parameters ---------------------------------------------------------------------------------------------
    def layer_modules(self, layer: int, dtype: Optional[torch.dtype] = None) -> Dict[str, nn.Module]:
        return {}

    def final_modules(self, dtype: Optional[torch.dtype] = None) -> Dict[str, nn.Module]:
        return {}

    @classmethod
    def owns(cls, param_name: str) -> bool:
        """Whether a parameter (any naming: Megatron, canonical, Hugging Face) is one of this mechanism's."""
        parts = param_name.split(".")
        return any(m in parts for m in cls.module_names)

    def decays(self, param_name: str, param: Tensor) -> bool:
        """Weight decay for one of this mechanism's parameters (default: Megatron's rule, matrices only)."""
        return param.dim() >= 2 and not param_name.endswith(".bias")

    def weight_decay_applies(self, param_name: str, param: Tensor) -> bool:
        """The one weight-decay rule of every trainer: Megatron's (matrices, not biases or 1-D parameters), with
        the mechanism deciding for its own parameters."""
        if self.owns(param_name):
            return self.decays(param_name, param)
        return param.dim() >= 2 and not param_name.endswith(".bias")

    def random_init(self, param_name: str, shape: Sequence[int], generator: torch.Generator) -> Optional[Tensor]:
        """The initial value of a parameter drawn at random (from a generator keyed by seed and name), or None
        when its module's constructor already holds the init (the usual case: the init is part of the math)."""
        return None

    def output_init_scale(self) -> float:
        """Factor on the std of the residual-branch output projections (attention out, FFN down)."""
        return 1.0

    @property
    def homogeneous_layers(self) -> bool:
        """False when layers hold differently shaped parameters (checkpoints then key them per layer)."""
        return True

    @property
    def value_heads_per_query_head(self) -> bool:
        """True when attention values get one head per query head (Depth-Attention's per-query-head mixing)."""
        return False

    # --- forward ------------------------------------------------------------------------------------------------
    def initial_state(self, embedding: Tensor):
        raise NotImplementedError

    def layer_forward(self, layer, state):
        """One transformer layer on the state; returns the new state."""
        raise NotImplementedError

    def prepare(self, layers: Sequence, state) -> None:
        """Set up, outside any compiled layer, what spans the `layers` that run next (Block AttnRes: each block's
        stacked queries for its phase 1)."""

    def run_layers(self, layers: Sequence, state):
        """Consecutive layers of one stage (or one recompute chunk): `prepare`, then layer by layer, through the
        compiled layer_forward where --compile-layers set one (not while recording: a probe reads weights out)."""
        self.prepare(layers, state)
        forward = self.compiled_layer_forward if self.recorder is None else None
        for layer in layers:
            state = (forward or self.layer_forward)(layer, state)
        return state

    def final_hidden(self, state, decoder) -> Tensor:
        """The hidden state that feeds the final norm, after the last layer."""
        raise NotImplementedError

    # --- pipeline payload ---------------------------------------------------------------------------------------
    def layout(self, boundary: int) -> List[Entry]:
        """The entries of the state before global layer `boundary` (0-based; num_layers = after the last)."""
        raise NotImplementedError

    def entries(self, state) -> Dict[str, Tensor]:
        raise NotImplementedError

    def state_from(self, entries: Dict[str, Tensor], boundary: int):
        raise NotImplementedError

    def flat(self, name: str, t: Tensor) -> Tensor:
        """An entry as [s_local, b, width] for the packed payload."""
        return t

    def unflat(self, name: str, t: Tensor) -> Tensor:
        return t

    # --- cost model ---------------------------------------------------------------------------------------------
    def io_units(self, fused: bool = True) -> float:
        """Forward memory traffic of the depth mixing per token, in units of d, summed over the model: the
        standard residual's is 3 per sublayer (read x, read f(x), write x + f(x)). fused: the fast path's
        (--mixing-impl triton) where it differs from the eager reference's. tools/bench_throughput.py turns the
        excess over the standard residual into the step-time bound of memory traffic alone."""
        raise NotImplementedError(f"{self.name} has no I/O model: give it io_units() (mega_depth/model/base.py)")

    def kernel_io_units(self, recompute: bool = True) -> float:
        """What the fused mixing kernels (--mixing-impl triton) move in one training step, forward, the backward's
        recomputation (`recompute`: --mixing-recompute) and backward, in units of one [tokens, d] activation at the
        activation dtype; an fp32 tensor counts twice its bf16 size. Counted per kernel launch as the kernels do
        their work: every tensor a launch touches once (what a launch re-reads from cache is not traffic, a second
        launch over the same rows is), a source's gradient stored by its first reader and read and written by each
        other (sunk_gradients), a gradient that autograd adds instead not at all (its add is eager traffic, which
        the step trace counts apart). Tensors a few values per token wide are left out. The step trace's recorded
        launches must agree within 10 % at the 1B shape (tests/integration/test_step_trace.py)."""
        raise NotImplementedError(f"{self.name} has no kernel I/O model: give it kernel_io_units() "
                                  "(mega_depth/model/base.py)")

    def training_io_units(self, fused: bool = True) -> float:
        """The depth mixing's memory traffic in one training step, per token in units of d, as the analytic bound
        takes it (tools/bench_throughput.py): fused, the kernels' (kernel_io_units) plus 6 per sublayer where the
        sublayers' outputs still join by plain adds (forward: read 2, write 1; backward: the same for the
        gradient); unfused, three times the forward's (io_units), a rough estimate. Eager ops outside the kernels
        (HC's coefficient math) are not counted: the step trace measures those."""
        if not fused:
            return 3 * self.io_units(False)
        adds = 6.0 * self.shape.num_sublayers if self.plain_residual_adds else 0.0
        return self.kernel_io_units() + adds

    # --- fast paths ---------------------------------------------------------------------------------------------
    @property
    def fast_path(self) -> bool:
        """A fast path is selected (--mixing-impl compiled|triton) and nothing is being recorded."""
        return self.kernels is not None and self.recorder is None

    @property
    def fused(self) -> bool:
        """The fast path is the fused kernels' (--mixing-impl triton), not compiled twins of the reference."""
        return self.fast_path and getattr(self.kernels, "fused", False)

    @property
    def recomputes(self) -> bool:
        """On the fast path, recompute in backward what the mixing makes instead of keeping it (--mixing-recompute;
        never while recording: a recomputed forward would record twice)."""
        return self.fast_path and self.recompute_mixing

    def kernel(self, name: str, reference):
        """The fast twin of a mixing function on the fast path; the eager reference otherwise."""
        return getattr(self.kernels, name, reference) if self.fast_path else reference

    def recompute(self, fn: Callable, *tensors: Optional[Tensor]):
        """recompute(fn, *tensors) through the fast path's checkpoint where it has one (the fused kernels': the
        readers of one source, in recomputed regions or not, add their gradients into one buffer)."""
        return self.kernel("recompute", recompute)(fn, *tensors)

    def recomputed(self, make: Callable[..., Tensor], *sources: Optional[Tensor],
                   normalised: Optional[Callable[..., Tensor]] = None) -> Recomputed:
        """A sublayer input make(*sources), recomputed in backward through this mechanism's checkpoint; normalised:
        the fast path's op that makes it and normalises it as the host's norm (`Recomputed.normalised`)."""
        return Recomputed(make, sources, self.kernel("recompute", recompute), remakes=self.fused,
                          normalised=normalised if self.fused else None)


def option_fields(mechanisms: Sequence[type]) -> List[Tuple[str, Any, dataclasses.Field]]:
    """Dataclass fields for every option of `mechanisms`; an option declared twice must agree."""
    seen: Dict[str, Option] = {}
    for mech in mechanisms:
        for opt in mech.options:
            if opt.name in seen and seen[opt.name] != opt:
                raise TypeError(f"option {opt.name} is declared differently by two mechanisms")
            seen[opt.name] = opt
    fields = []
    for opt in seen.values():
        kind = Optional[opt.type] if opt.default is None else opt.type
        fields.append((opt.name, kind, dataclasses.field(default=opt.default, metadata={
            "help": opt.help, "choices": opt.choices, "unrecorded": opt.unrecorded})))
    return fields
