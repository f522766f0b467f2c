"""The RNG streams of one process as tensors and plain values, so that a checkpoint restores them with
torch.load(weights_only=True): Python's `random`, NumPy's global generator, torch's CPU (and CUDA) generators,
and, on the Megatron backends, the model-parallel RNG tracker."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch


def capture(tracker=None) -> dict:
    version, values, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"random": [version, list(values), gauss],
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tracker.get_states() if tracker is not None else None}


def restore(state: dict, tracker: Optional[object] = None) -> None:
    version, values, gauss = state["random"]
    random.setstate((version, tuple(values), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if tracker is not None and state["tracker"] is not None:
        tracker.set_states(state["tracker"])
