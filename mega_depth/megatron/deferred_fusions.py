"""Import megatron-core with its fusions' `torch.compile` deferred to their first call (entry points call
`import_megatron()` before anything imports megatron; never a side effect of an import).

Megatron wraps its fused element-wise functions (bias-GeLU, bias-SwiGLU, bias-dropout-add, ...) in `torch.compile`
as its modules are imported (`megatron.core.jit.jit_fuser`): about 40 wrappers, whose set-up imports Inductor and
builds Dynamo's state, ~2 s of every process's start (a quarter of a tiny run's) before the run knows whether it
calls one. Most runs call none of them (our layers use their own fused ops). Here each wrapper is made on the
function's first call instead: the same `torch.compile(fn)`, with the same defaults, so a run that calls one gets
the same compiled function. Inside a region that Dynamo is tracing (`--compile-layers`) the function is called as
it is, which is what Dynamo does with a nested `torch.compile` wrapper: it inlines the original function.

Megatron's inference context and timers also try `import wandb` as they are imported, for writers that training
never passes them: ~0.9 s of every process. While megatron is imported here that import fails as if wandb were
absent (their `except ImportError` path); a run with `--wandb-project` imports wandb itself afterwards.
"""

from __future__ import annotations

import functools
import importlib
import sys

import torch


def _deferred(compile_fn):
    def compile_on_first_call(model=None, **options):
        if model is None or options or not callable(model) or isinstance(model, torch.nn.Module):
            return compile_fn(model, **options) if model is not None else compile_fn(**options)
        compiled = []

        @functools.wraps(model)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return model(*args, **kwargs)
            if not compiled:
                compiled.append(compile_fn(model))
            return compiled[0](*args, **kwargs)

        return call

    return compile_on_first_call


def import_megatron() -> None:
    """Import megatron-core (once); its fusions compile on their first call, and its optional wandb writers stay
    off. A no-op once megatron is imported."""
    if "megatron.core" in sys.modules:
        return
    real_compile = torch.compile
    torch.compile = _deferred(real_compile)
    hide_wandb = "wandb" not in sys.modules
    if hide_wandb:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError
    try:
        # megatron.core.jit keeps the deferring maker as its jit_fuser: modules imported later defer too
        import megatron.core  # noqa: F401

        # the two modules that try wandb (every layer module imports the first), while it is hidden
        for name in ("megatron.core.inference_params", "megatron.core.timers"):
            importlib.import_module(name)
    finally:
        torch.compile = real_compile
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]
