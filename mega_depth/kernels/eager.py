"""Eager calls of the mixing's custom ops without torch.library's dispatch.

Each op is a `torch.library.custom_op` with registered autograd, so that torch.compile, fake tensors and the
ahead-of-time check see one opaque op. In eager mode that dispatch is pure host time: a custom-op call walks the
dispatcher, Dynamo's disable wrapper and the autograd glue: an AttnRes mix's forward and backward cost the host
0.41 ms as an op and 0.27 ms through an autograd.Function (one CPU thread, launches recorded), once per mixing call,
on a GPU's critical path where the step is host-bound (`tools/bench_host.py`). `call(op, *args)` runs the same
implementation, context setup and backward as the registration, through a plain autograd.Function where nothing
traces the call, and the op itself where something does.

    autograd(op, backward, setup_context)    # in place of op.register_autograd(backward, setup_context=...)
    call(op, *args)                          # in place of op(*args), forward ops and backward ops alike

A call's glue is host time on the GPU's critical path, once per op call forward and once backward (Block AttnRes:
about 60 op calls and their backward a 1B micro-batch), so the common case is kept short: an op whose arguments
hold no list of tensors passes them to apply as they are (no flattening), its context is the Function's own (its
`needs_input_grad` cut to the op's arguments once, in forward), and apply is torch's C entry where no functorch
transform is active (`Function.apply`'s Python wrapper only binds defaults, which these Functions have none of, and
unwraps functorch's dead wrappers, which only a transform makes).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

_FUNCTIONS: Dict[Any, type] = {}  # op -> its eager autograd.Function (ops with registered autograd)


_PLAIN = (Tensor, nn.Parameter)
# What a list argument holds in an eager call: plain tensors and the flags beside them. Checked as one set
# operation in C (a Full AttnRes step passes 10,000 list elements through `traced`)
_EAGER_ELEMENTS = frozenset((Tensor, nn.Parameter, bool, int, float, type(None)))


def traced(args: Sequence[Any]) -> bool:
    """Whether this call is being traced (Dynamo, AOTAutograd's fake or functional tensors, a proxy): then the op
    must stay one opaque node. Plain tensors and parameters are eager."""
    if torch.compiler.is_compiling():
        return True
    for a in args:
        kind = type(a)
        if kind in _PLAIN:
            continue
        if kind is list or kind is tuple:
            if _EAGER_ELEMENTS.issuperset(map(type, a)):
                continue
            for t in a:
                if isinstance(t, Tensor) and type(t) not in _PLAIN:
                    return True
        elif isinstance(a, Tensor):
            return True
    return False


def _flatten(args: Sequence[Any]) -> Tuple[Sequence[Any], Optional[Tuple[int, ...]]]:
    """The op's arguments as apply's flat arguments (a list argument's tensors one by one) and each argument's
    length (-1: not a list); (args, None) where no argument is a list."""
    for a in args:
        if type(a) is list or type(a) is tuple:
            break
    else:
        return args, None
    flat, spec = [], []
    for a in args:
        if isinstance(a, (list, tuple)):
            flat.extend(a)
            spec.append(len(a))
        else:
            flat.append(a)
            spec.append(-1)
    return flat, tuple(spec)


def _unflatten(flat: Sequence[Any], spec: Tuple[int, ...]) -> List[Any]:
    out, i = [], 0
    for n in spec:
        if n < 0:
            out.append(flat[i])
            i += 1
        else:
            out.append(list(flat[i:i + n]))
            i += n
    return out


class _Context:
    """The op's autograd context as its registered functions see it: `needs_input_grad` per op argument (any of a
    list argument's tensors; worked out when asked, mostly in backward), everything else the Function's own
    context."""

    def __init__(self, ctx, spec: Tuple[int, ...]):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_spec", spec)

    def __getattr__(self, name):
        if name != "needs_input_grad":
            return getattr(self._ctx, name)
        needs = _unflatten(self._ctx.needs_input_grad[1:], self._spec)
        needs = tuple(any(n) if isinstance(n, list) else n for n in needs)
        object.__setattr__(self, "needs_input_grad", needs)
        return needs

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


def _function(op, backward: Callable, setup_context: Callable) -> type:
    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, spec, *flat):
            if spec is None:  # no list argument: the flat arguments are the op's
                args = flat
                ctx.needs_input_grad = ctx.needs_input_grad[1:]
                view = ctx
            else:
                args = _unflatten(flat, spec)
                view = _Context(ctx, spec)
            out = op._init_fn(*args)
            ctx.spec, ctx.many = spec, isinstance(out, (list, tuple))
            setup_context(view, args, out)
            return tuple(out) if ctx.many else out

        @staticmethod
        def backward(ctx, *grads):
            spec = ctx.spec
            got = backward(ctx if spec is None else _Context(ctx, spec), list(grads) if ctx.many else grads[0])
            if spec is None:
                return (None, *got)
            flat = [None]  # spec
            for n, g in zip(spec, got):
                if n < 0:
                    flat.append(g)
                else:
                    flat.extend([None] * n if g is None else g)
            return tuple(flat)

    Eager.__name__ = f"Eager_{op._name}"
    # torch's C apply, bound to this class: Function.apply less its Python wrapper (see the module's docstring)
    Eager.c_apply = super(torch.autograd.Function, Eager).apply
    return Eager


def autograd(op, backward: Callable, setup_context: Callable) -> None:
    """op.register_autograd(backward, setup_context=setup_context), and the same for `call`'s eager path."""
    op.register_autograd(backward, setup_context=setup_context)
    _FUNCTIONS[op] = _function(op, backward, setup_context)


def call(op, *args):
    """op(*args), through the eager autograd.Function (or, for an op without autograd, its implementation) where
    the call is not traced. Under torch.profiler the call is a range named as the op (mega_depth::...), as the op's
    own dispatch would record it."""
    if traced(args):
        return op(*args)
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(op._qualname):
            return _call(op, args)
    return _call(op, args)


def _call(op, args):
    function = _FUNCTIONS.get(op)
    if function is None:
        return op._init_fn(*args)
    if not torch.is_grad_enabled():
        return op._init_fn(*args)
    flat, spec = _flatten(args)
    for t in flat:
        if isinstance(t, Tensor) and t.requires_grad:
            break
    else:
        return op._init_fn(*args)
    if torch._C._are_functorch_transforms_active():
        out = function.apply(spec, *flat)
    else:
        out = function.c_apply(spec, *flat)
    return list(out) if type(out) is tuple else out
