"""tools/graph_check.py's verdict: a captured step passes only where its losses and its gradient norms are the eager
step's (equal on a CPU, within the tolerances on a GPU). The dry run of the whole tool is in tests/e2e/test_tools.py."""

import os
import sys

import pytest

from fixtures import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
from graph_check import _worst, agrees  # noqa: E402


def _result(losses, norms, captured=True, update_gap=0.0):
    losses = {"eager": losses[0], "graphed": losses[1]}
    norms = {"eager": norms[0], "graphed": norms[1]}
    return {"captured": captured, "losses": losses, "grad_norms": norms,
            "max_relative_difference": _worst(losses), "max_relative_grad_norm_difference": _worst(norms),
            "relative_update_difference": update_gap, "updates_equal": update_gap == 0}


SAME = ([5.0, 4.5, 4.0], [5.0, 4.5, 4.0])


@pytest.mark.parametrize("gpu", [False, True])
def test_equal_losses_and_norms_pass(gpu):
    assert agrees(_result(SAME, ([2.0, 1.5, 1.2], [2.0, 1.5, 1.2])), 2e-3, 1e-2, gpu)


@pytest.mark.parametrize("gpu", [False, True])
def test_a_replay_whose_gradient_norm_is_off_fails_though_its_losses_match(gpu):
    """A stale or missing gradient leaves the step's loss as it was: only the norm shows it."""
    assert not agrees(_result(SAME, ([2.0, 1.5, 1.2], [2.0, 1.5, 1.3])), 2e-3, 1e-2, gpu)


def test_a_gpu_allows_its_tolerances_and_a_cpu_none():
    close = _result(([5.0, 4.5], [5.0, 4.5 * (1 + 1e-3)]), ([2.0, 1.5], [2.0, 1.5 * (1 + 5e-3)]))
    assert agrees(close, 2e-3, 1e-2, gpu=True) and not agrees(close, 2e-3, 1e-2, gpu=False)
    assert not agrees(close, 2e-3, 1e-3, gpu=True)  # the norm past its tolerance


@pytest.mark.parametrize("gpu", [False, True])
def test_weights_updated_otherwise_fail_though_losses_and_norms_match(gpu):
    """A parameter that the captured optimizer step left out (or updated twice) shows in the weights alone."""
    assert not agrees(_result(SAME, ([2.0, 1.5, 1.2], [2.0, 1.5, 1.2]), update_gap=0.05), 2e-3, 1e-2, gpu)
    # within the norms' tolerance on a GPU, where two eager runs' updates differ too; never on a CPU
    near = _result(SAME, ([2.0, 1.5, 1.2], [2.0, 1.5, 1.2]), update_gap=1e-3)
    assert agrees(near, 2e-3, 1e-2, gpu=True) and not agrees(near, 2e-3, 1e-2, gpu=False)


def test_a_nan_norm_or_no_capture_fails():
    assert _worst({"eager": [1.0, 2.0], "graphed": [1.0, float("nan")]}) == float("inf")
    assert not agrees(_result(SAME, ([2.0, 1.5, 1.2], [2.0, float("nan"), 1.2])), 2e-3, 1e-2, gpu=True)
    assert not agrees(_result(SAME, ([2.0, 1.5, 1.2], [2.0, 1.5, 1.2]), captured=False), 2e-3, 1e-2, gpu=False)
