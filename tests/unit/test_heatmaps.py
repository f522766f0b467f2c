"""The depth-weight figures: rows read as what they are (the output aggregation by name), the colour bar says what
its numbers are, and a stream mix (mHC's H_res, HC's A_r) is an n x n grid per sublayer."""

import math
import os

import pytest
import torch

from mega_depth.catalogue import residual_settings
from mega_depth.config import parse_args
from mega_depth.model.base import Recorder
from mega_depth.model.decoder import CausalLM
from mega_depth.training.heatmaps import COLORBAR_LABEL, heatmap_figure


def recorded(setting, layers=4):
    cfg = parse_args(["--num-layers", str(layers), "--hidden-size", "32", "--num-attention-heads", "4",
                      "--mock-data", "--vocab-size", "64"])
    for key, value in residual_settings(setting, layers).items():
        setattr(cfg.residual, key, value)
    model = CausalLM(cfg.decoder_config())
    recorder = Recorder()
    model.model.mechanism.recorder = recorder
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8)))
    return recorder.figures


def test_attnres_rows_name_every_sublayer_and_the_output():
    rows = recorded("attnres-full")["attnres"]
    labels = [label for _, label in sorted(rows)]
    assert labels[0] == "sublayer 1 (attn 0)" and labels[7] == "sublayer 8 (mlp 3)"
    assert labels[-1] == "output (final norm)" and len(labels) == 9  # 4 layers: 8 sublayers, then the output
    fig = heatmap_figure(rows, "attnres")
    assert fig.axes[-1].get_ylabel() == COLORBAR_LABEL


def test_mhc_stream_mix_is_an_n_by_n_grid_per_sublayer():
    figures = recorded("mhc", layers=2)
    grids = figures["mhc-H_res"]
    assert len(grids) == 4 and all(len(m) == 4 and all(len(row) == 4 for row in m) for m in grids.values())
    for m in grids.values():  # doubly stochastic per token, so the token mean is too
        torch.testing.assert_close(torch.tensor(m).sum(0), torch.ones(4), atol=1e-3, rtol=0)
        torch.testing.assert_close(torch.tensor(m).sum(1), torch.ones(4), atol=1e-3, rtol=0)
    fig = heatmap_figure(grids, "mhc-H_res")
    panels = [ax for ax in fig.axes if ax.get_title().startswith("sublayer")]
    assert len(panels) == 4 and panels[0].get_images()[0].get_array().shape == (4, 4)
    assert fig.axes[-1].get_ylabel() == COLORBAR_LABEL
    assert panels[0].get_xlabel() == "from stream" and panels[0].get_ylabel() == "to stream"
    hc = recorded("hc", layers=2)["hc-A_r"]
    assert all(len(m) == 4 and len(m[0]) == 4 for m in hc.values())


def test_the_input_dependent_querys_weights_are_drawn_with_their_spread_and_traced_in_tensorboard(tmp_path):
    """Beside the mean weights: a figure of how much they vary over tokens, and the softmax's entropy and logit
    spread per sublayer as TensorBoard scalars (where saturation shows), not as a picture."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mega_depth.model.base import STATS, TOKEN_SPREAD
    from mega_depth.training.heatmaps import SPREAD_LABEL
    from mega_depth.training.logger import Logger
    from mega_depth.training.report import IntervalMeter

    figures = recorded("attnres-input-query")
    assert {"attnres", "attnres" + TOKEN_SPREAD, "attnres" + STATS} <= set(figures)
    assert heatmap_figure(figures["attnres" + TOKEN_SPREAD], "spread", "attnres" + TOKEN_SPREAD
                          ).axes[-1].get_ylabel() == SPREAD_LABEL
    cfg = parse_args(["--mock-data", "--output-dir", str(tmp_path)])
    logger = Logger(cfg, 0, IntervalMeter(10, 1, 1.0, None, 1))
    paths = logger.heatmaps(figures, 5)
    logger.close()
    assert sorted(os.path.basename(p) for p in paths) == ["attnres token spread_step0000005.png",
                                                          "attnres_step0000005.png"]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for stat in ("entropy", "logit_std"):
        assert f"depth_stats/attnres/{stat}/mean" in tags
        assert f"depth_stats/attnres/{stat}/output_(final_norm)" in tags
    entropy = events.Scalars("depth_stats/attnres/entropy/sublayer_2_(mlp_0)")[0]
    assert entropy.step == 5 and entropy.value == pytest.approx(math.log(2), abs=1e-5)  # zero init: uniform
