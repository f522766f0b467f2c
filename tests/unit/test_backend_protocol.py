"""Every backend supplies what the one training loop uses (mega_depth/training/backend.py)."""

import inspect

import pytest

from mega_depth.training.backend import Backend


def members():
    return [name for name in dir(Backend) if not name.startswith("_")]


@pytest.mark.parametrize("path", ["mega_depth.training.backends.megatron:MegatronBackend",
                                  "mega_depth.training.backends.deepspeed:DeepSpeedBackend",
                                  "mega_depth.xla.backend:PlainBackend"])
def test_every_backend_has_the_protocols_members(path):
    import importlib

    module, name = path.split(":")
    cls = getattr(importlib.import_module(module), name)
    missing = [m for m in members() if not hasattr(cls, m)]
    assert not missing, f"{name} lacks {missing}"
    for member in members():  # methods keep the protocol's parameters
        ours, theirs = getattr(cls, member), getattr(Backend, member)
        if inspect.isfunction(theirs):
            assert list(inspect.signature(ours).parameters)[:len(inspect.signature(theirs).parameters)] == \
                list(inspect.signature(theirs).parameters), (name, member)
    assert {"moe_metrics", "forward_backward", "save_files", "sampler_shape"} <= set(members())
