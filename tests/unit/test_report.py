"""The memory estimate of --dry-run, term by term: what each precision, ZeRO stage and the distributed optimizer
divide, and the activation formula's pieces."""

import pytest

from mega_depth.config import parse_args
from mega_depth.training.report import IntervalMeter, memory_estimate

P = 1_000_000  # parameters on the rank


def cfg(*flags):
    return parse_args(["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "128", "--micro-batch-size", "2"] + list(flags))


def test_moe_layers_replace_the_mlp_share_with_k_token_copies_and_the_active_widths():
    """4 MoE layers of 4 experts, top-2, expert width 64 and a shared expert of 32, beside the dense width 192
    (8/3 x 64 rounded up to 64): 34 + 2k + 6 x (2 x 64 + 32 - 192) / 64 = 35 per layer; a dense first layer keeps 34."""
    s, b, h = 128, 2, 64
    moe = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
           "--moe-shared-expert-intermediate-size", "32")
    e = memory_estimate(cfg(*moe), P, dp=1, zero_stage=0, depth_state_units=0, world_size=1)
    assert e.activations == pytest.approx(4 * s * b * h * 35 * 2)
    first_dense = memory_estimate(cfg(*moe, "--moe-layer-freq", "([0]*1+[1]*3)"), P, dp=1, zero_stage=0,
                                  depth_state_units=0, world_size=1)
    assert first_dense.activations == pytest.approx(s * b * h * (34 + 3 * 35) * 2)


def test_weights_gradients_and_adam_by_precision_and_sharding():
    e = memory_estimate(cfg(), P, dp=4, zero_stage=0, depth_state_units=0, world_size=4)
    assert (e.weights, e.gradients, e.optimizer) == (4 * P, 4 * P, 8 * P)  # fp32: weights, grads, two moments
    e = memory_estimate(cfg("--bf16"), P, dp=4, zero_stage=0, depth_state_units=0, world_size=4)
    assert (e.weights, e.gradients, e.optimizer) == (2 * P, 4 * P, 12 * P)  # + fp32 masters in the optimizer
    e = memory_estimate(cfg("--use-distributed-optimizer"), P, dp=4, zero_stage=0, depth_state_units=0, world_size=4)
    assert (e.weights, e.gradients, e.optimizer) == (4 * P, 4 * P, 2 * P)
    z2 = memory_estimate(cfg(), P, dp=4, zero_stage=2, depth_state_units=0, world_size=4)
    z3 = memory_estimate(cfg(), P, dp=4, zero_stage=3, depth_state_units=0, world_size=4)
    assert (z2.weights, z2.gradients, z2.optimizer) == (4 * P, P, 2 * P) and z3.weights == P


def test_activations_follow_the_layer_formula_and_add_the_carried_depth_state():
    s, b, h = 128, 2, 64
    e = memory_estimate(cfg(), P, dp=1, zero_stage=0, depth_state_units=0, world_size=1)
    assert e.activations == pytest.approx(4 * s * b * h * 34 * 2)  # 4 layers, SDPA (no score term), fp32 = 2x
    unfused = memory_estimate(cfg("--attention-backend", "unfused"), P, dp=1, zero_stage=0, depth_state_units=0,
                              world_size=1)
    assert unfused.activations == pytest.approx(4 * s * b * h * (34 + 5 * 4 * s / h) * 2)
    # the state carried past the one hidden state the layer formula counts (the standard residual's: none)
    assert memory_estimate(cfg(), P, dp=1, zero_stage=0, depth_state_units=1, world_size=1) == e
    with_state = memory_estimate(cfg(), P, dp=1, zero_stage=0, depth_state_units=10, world_size=1)
    assert with_state.activations - e.activations == pytest.approx(9 * s * b * h * 4)
    sp = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
    sp_base = memory_estimate(cfg(*sp), P, dp=1, zero_stage=0, depth_state_units=1, world_size=2)
    sp_state = memory_estimate(cfg(*sp), P, dp=1, zero_stage=0, depth_state_units=10, world_size=2)
    assert sp_state.activations - sp_base.activations == pytest.approx(9 * s * b * h * 4 / 2)  # sharded by sequence
    full = memory_estimate(cfg("--recompute-granularity", "full"), P, dp=1, zero_stage=0, depth_state_units=0,
                           world_size=1)
    assert full.activations == pytest.approx(4 * 2 * s * b * h * 2)
    # 1F1B: the first of 2 stages holds 2 micro-batches of its 2 layers
    pp = memory_estimate(cfg("--pipeline-model-parallel-size", "2", "--global-batch-size", "8"), P, dp=1,
                         zero_stage=0, depth_state_units=0, world_size=2)
    assert pp.activations == pytest.approx(e.activations)


def test_the_interval_line_averages_the_interval_and_takes_the_eta_after_the_first_step():
    meter = IntervalMeter(total_steps=10, tokens_per_step=1000, flops_per_step=2e12, peak_flops=1e12, world_size=2)
    for seconds in (5.0, 1.0):  # the first step compiles
        meter.add(seconds)
    line = meter.line(2)
    assert line.startswith("3,000.0 ms/step | 333 tokens/s | MFU 33.3% | ETA 0:00:08"), line
    meter.add(3.0)
    assert meter.line(3).startswith("3,000.0 ms/step | 333 tokens/s | MFU 33.3% | ETA 0:00:14")  # (1 + 3) / 2 x 7


@pytest.mark.parametrize("flags, line", [
    ((), "evaluation: at the last step (10 batches)"),
    (("--eval-interval", "5"), "evaluation: every 5 steps and at the last step (10 batches)"),
    (("--eval-iters", "0"), "evaluation: none"),
])
def test_the_summary_says_when_the_run_evaluates(flags, line):
    from mega_depth.training.report import ModelCounts, summary_lines
    from mega_depth.training.trainer import evaluates

    c = cfg("--train-iters", "20", *flags).validate(1)
    lines = summary_lines(c, ModelCounts(1000, 10, 6e3), {"tp": 1, "pp": 1, "dp": 1}, (2, 1, 1, 0), 1, None, 0,
                          evaluates(c))
    assert line in lines, lines


def test_moe_flops_count_the_experts_a_token_runs():
    """An MoE layer's MLP FLOPs are top-k x the expert width (plus a shared expert's): top-2 experts half the dense
    width cost what the dense layer costs; top-1 costs less; the dense first layer stays dense."""
    from mega_depth.training.report import model_counts

    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data",
            "--vocab-size", "256", "--seq-length", "32"]
    dense = model_counts(parse_args(base), 256).flops_per_token
    moe = ["--num-experts", "8", "--moe-ffn-hidden-size", "96", "--moe-layer-freq", "([0]*1+[1]*3)"]  # ffn 192
    assert model_counts(parse_args(base + moe), 256).flops_per_token == dense
    top1 = model_counts(parse_args(base + moe + ["--moe-router-topk", "1", "--moe-router-pre-softmax"]), 256)
    assert top1.flops_per_token == dense - 3 * 2 * 3 * (3 * 64 * 96)  # 3 layers x 3 matmuls of d x 96, fwd+bwd
    shared = model_counts(parse_args(base + moe + ["--moe-shared-expert-intermediate-size", "32"]), 256)
    assert shared.flops_per_token == dense + 3 * 2 * 3 * (3 * 64 * 32)


def test_dry_run_sizes_an_expert_parallel_layout_at_a_world_it_can_run_on():
    """In one process --dry-run sizes the layout's smallest world: a stage's ranks a multiple of TP x CP and of
    EP x expert TP (the shipped MoE configs' EP 8 was refused at TP x CP x PP = 1)."""
    import os

    from mega_depth.config import parse_args
    from mega_depth.training.dry_run import layout_world

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in ("1b-k3-attnres-moe.yaml", "1b-dsv4-mhc-moe.yaml"):
        cfg = parse_args(["--config", os.path.join(root, "launch", "configs", name), "--mock-data"])
        world = layout_world(cfg, 1)
        assert world == 8, (name, world)
        cfg.validate(world)  # no configuration error at that world
    layout = ["--mock-data", "--num-experts", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--pipeline-model-parallel-size", "2", "--num-layers", "4"]
    assert layout_world(parse_args(layout + ["--expert-model-parallel-size", "4",
                                             "--expert-tensor-parallel-size", "1"]), 1) == 8  # lcm(2, 4) x PP
    assert layout_world(parse_args(layout + ["--expert-model-parallel-size", "2"]), 1) == 8  # EP 2 x ETP 2
    assert layout_world(parse_args(layout + ["--expert-model-parallel-size", "2", "--context-parallel-size", "2",
                                             "--expert-tensor-parallel-size", "1"]), 16) == 16  # the launched one


def test_dry_run_places_each_parameter_as_megatron_does():
    """Per pipeline stage, by hand: TP splits the linear weights and the vocabulary, the last stage keeps its copy
    of the tied embedding, norms are replicated; interleaved chunks alternate between the stages."""
    from mega_depth.config import parse_args
    from mega_depth.training.dry_run import layout_world, parameters_per_stage

    cfg = parse_args(["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--num-query-groups", "2", "--ffn-hidden-size", "128", "--vocab-size", "256",
                      "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--num-layers-per-virtual-pipeline-stage", "1"])
    assert layout_world(cfg, 1) == 4 and layout_world(cfg, 8) == 8
    h, f, v, head = 64, 128, 256, 16
    layer = (h * (h + 2 * 2 * head) + h * h + 3 * h * f) // 2 + 2 * h + 2 * head  # linears / TP + norms
    embedding = v * h // 2
    assert parameters_per_stage(cfg, v) == [embedding + 2 * layer, embedding + 2 * layer + h]
