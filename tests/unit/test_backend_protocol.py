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


@pytest.mark.parametrize("path", ["mega_depth.megatron.layer:MegatronHost", "mega_depth.model.decoder:PlainHost",
                                  "mega_depth.kernels.aot:_Host"])
def test_every_host_offers_the_host_protocol_with_its_signatures(path):
    """The three hosts a mechanism runs in (Megatron's layer, the plain decoder's, the ahead-of-time check's
    stand-in) take the same arguments: an attention hook declared in model/base.py's Host is missing nowhere."""
    import importlib

    from mega_depth.model.base import Host

    module, name = path.split(":")
    cls = getattr(importlib.import_module(module), name)
    methods = [m for m in dir(Host) if not m.startswith("_") and inspect.isfunction(getattr(Host, m))]
    assert set(methods) == {"attention_sublayer", "attention_sublayer_recomputed", "mlp_sublayer"}
    for method in methods:
        assert inspect.signature(getattr(cls, method)).parameters.keys() == \
            inspect.signature(getattr(Host, method)).parameters.keys(), (name, method)
        defaults = {k: p.default for k, p in inspect.signature(getattr(Host, method)).parameters.items()}
        assert {k: p.default for k, p in inspect.signature(getattr(cls, method)).parameters.items()} == defaults
    assert "layer_index" in Host.__annotations__ and "self.layer_index =" in inspect.getsource(cls.__init__)
