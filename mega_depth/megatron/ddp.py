"""Megatron's DistributedDataParallel, whose gradient hooks hold it weakly, so that a closed backend is freed.

megatron-core registers one backward hook per parameter on the parameter's gradient accumulator (an autograd node,
C++), and the hook's closure holds the DDP wrapper, and through it the model, the optimizer's buffers and the
process groups. A graph that outlives its backward holds those accumulators too (MoE's router leaves one per
layer: its probabilities and their load-balancing scaler), and a reference held by C++ is one Python's collector
cannot see through: the cycle model -> graph -> accumulator -> hook -> model is never collected. After `close()`
every MoE build kept its whole model and ~50 gloo threads a rank (so the layout tests gave each MoE layout a
launch of its own). Here each hook closes over a weak proxy of the wrapper instead: the same hook, the same calls
while the wrapper lives, and nothing kept once it is gone.
"""

from __future__ import annotations

import weakref

import torch
from megatron.core.distributed import DistributedDataParallel as MegatronDDP


class DistributedDataParallel(MegatronDDP):
    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        return MegatronDDP._make_backward_post_hook(weakref.proxy(self), param)
