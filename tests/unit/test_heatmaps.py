"""The depth-weight figures: rows read as what they are (the output aggregation by name), the colour bar says what
its numbers are, and a stream mix (mHC's H_res, HC's A_r) is an n x n grid per sublayer."""

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
