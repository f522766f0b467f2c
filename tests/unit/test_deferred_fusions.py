"""Megatron's fusions are wrapped in torch.compile on their first call, not at import (megatron/deferred_fusions.py):
the same wrapper then, the plain function inside a region Dynamo traces, and no Inductor at start-up."""

import torch

from fixtures import run
from mega_depth.megatron.deferred_fusions import _deferred


class CountingCompile:
    """A stand-in for torch.compile that records what it wrapped (and doubles the result, to tell it apart)."""

    def __init__(self):
        self.wrapped, self.options = [], []

    def __call__(self, model=None, **options):
        self.wrapped.append(model)
        self.options.append(options)
        if model is None:
            return lambda fn: fn
        return model if isinstance(model, torch.nn.Module) else (lambda *a, **k: 2 * model(*a, **k))


def bias_gelu(bias, y):
    return torch.nn.functional.gelu(bias + y)


def test_a_fusion_compiles_on_its_first_call_once():
    compile_fn = CountingCompile()
    fused = _deferred(compile_fn)(bias_gelu)
    assert compile_fn.wrapped == [] and fused.__name__ == "bias_gelu"  # decorating costs nothing
    x, b = torch.randn(3, 4), torch.randn(4)
    torch.testing.assert_close(fused(b, x), 2 * bias_gelu(b, x))  # the compiled function runs
    fused(b, x)
    assert compile_fn.wrapped == [bias_gelu] and compile_fn.options == [{}]


def test_options_modules_and_decorator_factories_compile_at_once():
    compile_fn = CountingCompile()
    deferred = _deferred(compile_fn)
    deferred(bias_gelu, mode="max-autotune")
    layer = torch.nn.Linear(2, 2)
    assert deferred(layer) is layer
    deferred(fullgraph=True)
    assert compile_fn.wrapped == [bias_gelu, layer, None]
    assert compile_fn.options == [{"mode": "max-autotune"}, {}, {"fullgraph": True}]


def test_inside_a_traced_region_the_plain_function_runs():
    def refuse(*args, **kwargs):
        raise AssertionError("compiled while Dynamo traced")

    fused = _deferred(refuse)(bias_gelu)
    layer = torch.compile(lambda b, x: fused(b, x) * 3, backend="eager", fullgraph=True)
    x, b = torch.randn(3, 4), torch.randn(4)
    torch.testing.assert_close(layer(b, x), 3 * bias_gelu(b, x))


def test_import_megatron_leaves_inductor_and_wandb_unimported_and_torch_compile_as_it_was():
    probe = ("import sys, torch; real = torch.compile\n"
             "from mega_depth.megatron.deferred_fusions import import_megatron\n"
             "import_megatron(); import megatron.core.jit as jit\n"
             "from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl\n"
             "assert torch.compile is real\n"
             "assert jit.jit_fuser.__name__ == 'compile_on_first_call', jit.jit_fuser\n"
             "assert 'torch._inductor.compile_fx' not in sys.modules\n"
             "import megatron.core.inference.contexts.dynamic_context as ctx, megatron.core.timers as timers\n"
             "assert 'wandb' not in sys.modules and ctx.wandb is None and timers.wandb is None\n"
             "import wandb; assert wandb.init, wandb  # the real package, for --wandb-project\n"
             "print('ok')")
    assert run(["-c", probe]).stdout.strip() == "ok"
