"""The benchmark tools run (tiny sizes), so that they cannot rot."""

import json
import os
import statistics
import sys

import pytest

from fixtures import ROOT, run
from mega_depth.catalogue import SETTINGS


def test_bench_throughput_reports_time_memory_and_bounds_against_the_baseline(tmp_path):
    out = tmp_path / "bench.json"
    stdout = run(["tools/bench_throughput.py", "--hidden-size", "32", "--num-layers", "2", "--seq-length", "32",
                  "--steps", "1", "--rounds", "2", "--out", str(out)]).stdout
    report = json.loads(out.read_text())
    results = {r["mechanism"]: r for r in report["results"]}
    assert list(results) == list(SETTINGS)
    for r in results.values():
        assert r["step_time_s"] > 0 and r["baseline_step_time_s"] > 0 and len(r["overhead_pct_by_round"]) == 2
        assert r["step_time_ratio"] == r["step_time_s"] / r["baseline_step_time_s"]
        assert r["saved_bytes_ratio"] == r["saved_bytes"] / results["standard"]["saved_bytes"]
        assert r["baseline_mfu"] is None  # no GPU peak on a CPU
        assert r["analytic_bound_ratio"] >= 1.0
    # activation memory is machine-independent: reading every earlier output keeps more for backward than the
    # plain residual; the bound is 1 exactly where nothing is added
    assert results["attnres-full"]["saved_bytes"] > results["standard"]["saved_bytes"]
    assert results["standard"]["analytic_bound_ratio"] == 1.0 and results["attnres-full"]["analytic_bound_ratio"] > 1
    assert "vs base" in stdout and "baseline MFU" in stdout
    # pair by pair, the JSON is rewritten as each mechanism finishes (a time-boxed GPU run keeps what it measured)
    assert report["complete"] is True
    assert all(f"measured {name}: " in stdout for name in SETTINGS)


def test_bench_host_times_the_hosts_work_per_setting_against_the_baseline(tmp_path):
    out = tmp_path / "host.json"
    stdout = run(["tools/bench_host.py", "--mechanisms", "attnres-block,mhc", "--repeats", "2", "--rounds", "2",
                  "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
                  "--micro-batch-size", "1", "--out", str(out)]).stdout
    results = json.loads(out.read_text())["settings"]
    assert list(results) == ["standard", "attnres-block", "mhc"]
    for name, r in results.items():  # two rounds of two repeats each, every one timed, each after the baseline
        assert len(r["samples_ms"]) == (12 if name == "standard" else 4) and all(t > 0 for t in r["samples_ms"])
        assert len(r["round_ratios"]) == 2 and r["host_ratio"] == pytest.approx(statistics.median(r["round_ratios"]))
    assert results["standard"]["round_ratios"] == [1.0, 1.0]
    # a mechanism's pass calls more from Python than the baseline's (its mixing ops, their autograd glue)
    assert results["mhc"]["python_calls"] > results["standard"]["python_calls"] > 1000
    assert results["mhc"]["python_calls_ratio"] == results["mhc"]["python_calls"] / results["standard"]["python_calls"]
    assert "| mhc |" in stdout
    assert "--num-layers" in run(["tools/bench_host.py", "--hidden-size", "32"], expect=2).stderr


def test_analytic_io_model_follows_spec():
    """The per-sublayer I/O of each mechanism: the plain residual 3d; two-phase Block AttnRes n/S + 5; Full AttnRes
    reads every earlier output, so it overtakes Block as depth grows."""
    import sys

    sys.path.insert(0, "tools")
    from bench_throughput import io_units

    assert io_units({"mechanism": "standard"}, 24, 2048, 16, 16) == 3 * 48
    full = io_units({"mechanism": "attnres"}, 24, 2048, 16, 16)
    block = io_units({"mechanism": "attnres", "attnres_num_blocks": 8}, 24, 2048, 16, 16)
    assert full > block > 3 * 48
    assert block == sum(6 * (b / 6 + 5) for b in range(1, 9)) + 10
    hc = {"mechanism": "hc", "hc_expansion": 4}
    assert io_units(hc, 24, 2048, 16, 16, fused=False) == 48 * 34 + 5  # 34d per sublayer, the paper's HC row
    assert io_units(hc, 24, 2048, 16, 16, fused=True) == 48 * 18 + 5  # the stream kernels: (3n+1) + (n+1)
    from mega_depth.catalogue import residual_settings

    for name in SETTINGS:  # every setting has an I/O model
        assert io_units(residual_settings(name, 24), 24, 2048, 16, 8) >= 3 * 48


def test_the_bound_takes_the_training_model_of_the_kernels(monkeypatch):
    """The bound's traffic is a training step's as the fused kernels move it (Mechanism.training_io_units; the step
    trace checks each model against the recorded launches): the plain residual's 6 per sublayer (forward and the
    gradient's add); Full AttnRes's mixes of K = 1 .. 49 sources read them and write their input forward and again
    with the output gradient backward, with the forward's output (the softmax gradient's go . h). Source j is read by
    R = 49 - j mixes. By default (model/base.DEFER_READERS off) its gradient is stored by its first reader and added
    to by every other: 2R - 1, 49 ** 2 in all. With the sinks' sum from 4 readers (46 sources, 1,219 readers) each
    such source's readers leave their parts to it (each reader's output gradient read and 3 fp32 coefficients a
    token written and read, the source read, its gradient written: grad_sink.Sink.defer); the last 3 sources' are
    added in turn (1 + 3 + 5)."""
    import sys

    sys.path.insert(0, "tools")
    from bench_throughput import io_units, training_io_units
    from mega_depth.model import base

    assert training_io_units({"mechanism": "standard"}, 24, 2048, 16, 16) == 6 * 48
    mixes = sum(2 * (k + 1) + 1 for k in range(1, 50))
    full = training_io_units({"mechanism": "attnres"}, 24, 2048, 16, 16)
    assert full == pytest.approx(mixes + 49 ** 2)
    monkeypatch.setattr(base, "DEFER_READERS", 4)
    coefficients = 2 * 3 * 4 / (2 * 2048)  # [T, d] bf16 units
    summed = 1219 * (1 + coefficients) + 2 * 46 + (1 + 3 + 5)
    assert training_io_units({"mechanism": "attnres"}, 24, 2048, 16, 16) == pytest.approx(mixes + summed)
    assert training_io_units({"mechanism": "attnres"}, 24, 2048, 16, 16, fused=False) == 3 * io_units(
        {"mechanism": "attnres"}, 24, 2048, 16, 16, fused=False)


def test_bench_comm_measures_hops_and_matches_the_spec_formulas(tmp_path):
    out = tmp_path / "comm.json"
    run(["tools/bench_comm.py", "--grid", "2x2", "--num-layers", "4", "--hidden-size", "32", "--seq-length", "16",
         "--out", str(out)])
    report = json.loads(out.read_text())
    assert {(r["mechanism"], r["cache"]) for r in report} == {(m, c) for m in SETTINGS for c in (True, False)}
    assert all(r["matches_formula"] for r in report)
    full = {r["cache"]: r for r in report if r["mechanism"] == "attnres-full"}
    assert full[True]["peak_hop_bytes"] < full[False]["peak_hop_bytes"]  # cross-stage caching pays
    # the projection tool's bytes per hop (for the 1B / 7B configs) are the measured ones on this grid, exactly
    (tmp_path / "small.yaml").write_text("model: {num_layers: 4, hidden_size: 32, num_attention_heads: 4, "
                                         "num_query_groups: 2, seq_length: 16}\ntraining: {micro_batch_size: 1}\n")
    run(["tools/project_pipeline.py", "--configs", str(tmp_path / "small.yaml"), "--pp", "2", "--vpp", "2",
         "--bytes-per-element", "4", "--out", str(tmp_path / "proj.json")])
    projected = {r["mechanism"]: r["hop_bytes"] for r in json.loads((tmp_path / "proj.json").read_text())["rows"]}
    measured = {r["mechanism"]: r["bytes_per_hop"] for r in report if r["cache"]}
    assert projected == measured


def test_context_projection_halves_activations_and_counts_the_kv_gathers(tmp_path):
    """tools/project_context.py: a rank's activations scale as 1 / CP; its CP traffic per layer is forward, backward
    re-gather and gradient reduce-scatter of the other ranks' K and V (bf16): 3 x s x 2 x groups x head dim x 2 bytes
    x (CP - 1) / CP."""
    (tmp_path / "small.yaml").write_text("model: {num_layers: 4, hidden_size: 32, num_attention_heads: 4, "
                                         "num_query_groups: 2, seq_length: 16}\ntraining: {micro_batch_size: 1}\n")
    run(["tools/project_context.py", "--configs", str(tmp_path / "small.yaml"), "--seq", "16", "--cp", "1,2,4",
         "--out", str(tmp_path / "proj.json")])
    rows = {r["cp"]: r for r in json.loads((tmp_path / "proj.json").read_text())["rows"]}
    assert sorted(rows) == [1, 2, 4]
    kv = 16 * 2 * 2 * 8 * 2
    for cp, row in rows.items():
        assert row["cp_bytes_per_layer"] == 3 * kv * (cp - 1) / cp
        for name, gib in row["activation_gib"].items():
            assert gib == pytest.approx(rows[1]["activation_gib"][name] / cp), (cp, name)


def test_bench_quality_trains_every_seed_and_reports_the_spread(data, tmp_path):
    out = tmp_path / "quality"
    stdout = run(["tools/bench_quality.py", "--mechanisms", "standard,attnres-block", "--seeds", "0,1",
                  "--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--train-iters", "4",
                  "--eval-iters", "2", "--eval-interval", "2", "--data-path", str(data["dir"] / "docs"),
                  "--tokenizer-model", str(data["dir"] / "spm.model"), "--out-dir", str(out)]).stdout
    report = json.loads((out / "quality.json").read_text())
    results = {r["mechanism"]: r for r in report["results"]}
    assert list(results) == ["standard", "attnres-block"]
    for r in results.values():
        assert len(r["val_loss"]) == 2 and r["val_loss_min"] <= r["val_loss_mean"] <= r["val_loss_max"]
        assert r["tokens"] == 4 * 16 * 32  # iterations x global batch x sequence: the same for every mechanism
    r = results["attnres-block"]
    assert r["delta_vs_baseline"] == r["val_loss_mean"] - results["standard"]["val_loss_mean"]
    assert results["attnres-block"]["params"] > results["standard"]["params"]  # the mixing parameters
    assert results["standard"]["val_loss"][0] != results["standard"]["val_loss"][1]  # the seeds differ
    for plot in ("loss_vs_tokens.png", "loss_vs_time.png", "heatmap_attnres-block.png"):
        assert (out / plot).stat().st_size > 1000
    assert "vs baseline" in stdout


def test_the_profile_puts_a_settings_extra_device_time_down_kernel_by_kernel():
    """profile_step.over_baseline: the kernels whose time in the step differs most from the baseline's, new ones
    (the mixing's) and the baseline's own run more or less, largest difference first."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from profile_step import over_baseline

    base = {"every_kernel": {"gemm": {"ms": 10.0, "calls": 4}, "add": {"ms": 2.0, "calls": 8},
                             "norm": {"ms": 1.0, "calls": 2}}}
    own = {"every_kernel": {"gemm": {"ms": 10.1, "calls": 4}, "add": {"ms": 0.5, "calls": 2},
                            "norm": {"ms": 1.0, "calls": 2}, "_phase2_bwd_kernel": {"ms": 4.0, "calls": 48}}}
    rows = over_baseline(own, base, top=3)
    assert [(n, round(d, 6), t, c) for n, d, t, c in rows] == [("_phase2_bwd_kernel", 4.0, 4.0, 48),
                                                               ("add", -1.5, 0.5, 2), ("gemm", 0.1, 10.1, 4)]


def test_device_check_dry_run_measures_syncs_profile_and_throughput(tmp_path):
    """tools/device_check.sh at toy sizes on the CPU (SCALE=tiny): every step exits 0 and leaves its results, so the
    scarce GPU run does not fail on the script. The sync check found no host sync in any mechanism's forward and
    backward (on a CPU: host_sync.SyncDetector); the profile names the mixing's ops in Block AttnRes's step."""
    import subprocess
    import tarfile

    from fixtures import ENV, PY

    default = ["environment", "bench_kernels", "throughput_1b", "graph_check", "throughput_1b_graphed",
               "kernel_peers"]
    # FULL=1's first steps (the pipelined ops unpipelined, the GPU kernel tests, the profile, the sync check: 0
    # syncs in every GPU run); the rest of FULL=1 is left to the GPU
    full = ["kernels_unpipelined", "kernels", "profile_1b", "sync_check"]
    proc = subprocess.run(["bash", "tools/device_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(ENV, SCALE="tiny", OUT=str(tmp_path), PY=PY, FULL="1",
                                   ONLY=",".join(default + full)))
    summary = (tmp_path / "device_check.log").read_text()
    steps = dict(line.split(": exit ") for line in summary.strip().splitlines())
    assert list(steps) == default + full, summary
    assert all(v.startswith("0 ") for v in steps.values()), (summary, proc.stdout[-3000:])
    with tarfile.open(tmp_path / "device_check.tar.gz") as tar:
        tar.extractall(tmp_path / "results")
    syncs = json.loads((tmp_path / "results" / "sync_check.json").read_text())["results"]
    assert set(syncs) == set(SETTINGS) and all(r["forward_backward_syncs"] == [] for r in syncs.values())
    # no TE, no apex: the grad norm and its clip stay on the device (megatron/grad_norm.py)
    assert all(r["optimizer_syncs"] == [] for r in syncs.values()), {k: r["optimizer_syncs"] for k, r in syncs.items()}
    profile = json.loads((tmp_path / "results" / "profile.json").read_text())["results"]
    assert list(profile) == ["standard", "dca-2", "mhc"]
    assert profile["mhc"]["mixing_kernels_ms"] > 0 == profile["standard"]["mixing_kernels_ms"]
    markdown = (tmp_path / "results" / "profile.md").read_text()
    assert "| kernel | ms | % of busy |" in markdown
    # each mixing kernel (on a CPU: each mixing op) with its time and launches in the step
    assert {k["name"] for k in profile["mhc"]["mixing_kernels"]} >= {"mega_depth::mhc_projection"}
    assert {k["name"] for k in profile["dca-2"]["mixing_kernels"]} >= {"mega_depth::dca_grn"}
    assert all(k["calls"] >= 1 for k in profile["mhc"]["mixing_kernels"])
    # and what differs from the baseline's step, kernel by kernel (profile_step.over_baseline), for each mechanism
    assert markdown.count("| kernel | ms over the baseline | ms | launches |") == 2
    assert all(profile[m]["every_kernel"] for m in profile)
    kernels = json.loads((tmp_path / "results" / "kernels.json").read_text())["rows"]
    assert {(r["impl"], r["op"], r["status"]) for r in kernels} == {("mega_depth", "attnres_mix", "ok"),
                                                                    ("mega_depth", "attnres_block", "ok")}
    # and each phase's kernels (on a CPU, its operators): which of an op's kernels holds its time
    assert all(r["fwd_kernels"] and r["bwd_kernels"] for r in kernels), kernels
    # the peers' rows, in a step of their own after the ratios: each checked against ours or said to be skipped
    peers = json.loads((tmp_path / "results" / "kernel_peers.json").read_text())["rows"]
    assert peers and {r["impl"] for r in peers}.isdisjoint({"mega_depth"}), peers
    assert all(r["status"].startswith(("equal", "skipped")) for r in peers), peers
    # the captured step's plumbing (the capture stood in for on a CPU): the same losses as the eager step's
    graphs = json.loads((tmp_path / "results" / "graph_check.json").read_text())["results"]
    assert list(graphs) == ["standard", "attnres-block", "mhc"]
    assert all(r["ok"] and r["captured"] and r["max_relative_difference"] == 0 for r in graphs.values()), graphs
    # and the same gradient norms, step by step (a replay that left a gradient stale would still match the loss),
    # and the same updates of the weights
    assert all(len(r["grad_norms"]["graphed"]) == len(r["losses"]["graphed"]) and
               r["grad_norms"]["graphed"] == r["grad_norms"]["eager"] and
               all(0 < n < float("inf") for n in r["grad_norms"]["eager"]) and r["updates_equal"] and
               r["relative_update_difference"] == 0 for r in graphs.values()), graphs
    assert json.loads((tmp_path / "results" / "throughput_1b_graphed.json").read_text())["complete"]
