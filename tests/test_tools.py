"""The benchmark tools run (tiny sizes), so that they cannot rot."""

import json

from conftest import run


def test_bench_throughput_reports_every_mechanism_against_the_baseline(tmp_path):
    out = tmp_path / "bench.json"
    stdout = run(["tools/bench_throughput.py", "--hidden-size", "32", "--num-layers", "2", "--seq-length", "32",
                  "--steps", "1", "--rounds", "2", "--out", str(out)]).stdout
    report = json.loads(out.read_text())
    results = {r["mechanism"]: r for r in report["results"]}
    assert set(results) == {"standard", "attnres-full", "attnres-block", "dca", "dca-2", "depth-attention"}
    assert results["standard"]["throughput_ratio"] == 1.0
    for r in results.values():
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert abs(r["throughput_ratio"] * r["step_time_ratio"] - 1) < 1e-9
        assert len(r["overhead_pct_by_round"]) == 2
    assert results["standard"]["overhead_pct_by_round"] == [0.0, 0.0]
    assert "vs baseline" in stdout


def test_bench_comm_measures_hops_and_matches_the_spec_formulas(tmp_path):
    out = tmp_path / "comm.json"
    run(["tools/bench_comm.py", "--grid", "2x2", "--num-layers", "4", "--hidden-size", "32", "--seq-length", "16",
         "--out", str(out)])
    report = json.loads(out.read_text())
    assert {(r["mechanism"], r["cache"]) for r in report} == {
        (m, c) for m in ("standard", "attnres-full", "attnres-block", "dca", "dca-2", "depth-attention")
        for c in (True, False)}
    assert all(r["matches_formula"] for r in report)
    full = {r["cache"]: r for r in report if r["mechanism"] == "attnres-full"}
    assert full[True]["peak_hop_bytes"] < full[False]["peak_hop_bytes"]  # cross-stage caching pays


def test_bench_quality_trains_every_seed_and_reports_the_spread(data, tmp_path):
    out = tmp_path / "quality"
    stdout = run(["tools/bench_quality.py", "--mechanisms", "standard,attnres-block,dca-2", "--seeds", "0,1",
                  "--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--train-iters", "4",
                  "--eval-iters", "2", "--eval-interval", "2", "--data-path", str(data["dir"] / "docs"),
                  "--tokenizer-model", str(data["dir"] / "spm.model"), "--out-dir", str(out)]).stdout
    report = json.loads((out / "quality.json").read_text())
    results = {r["mechanism"]: r for r in report["results"]}
    assert list(results) == ["standard", "attnres-block", "dca-2"]
    for r in results.values():
        assert len(r["val_loss"]) == 2 and r["val_loss_min"] <= r["val_loss_mean"] <= r["val_loss_max"]
        assert r["tokens"] == 4 * 16 * 32  # iterations x global batch x sequence: the same for every mechanism
    assert results["standard"]["delta_vs_baseline"] == 0.0
    assert results["attnres-block"]["params"] > results["standard"]["params"]  # the mixing parameters
    assert results["standard"]["val_loss"][0] != results["standard"]["val_loss"][1]  # the seeds differ
    for plot in ("loss_vs_tokens.png", "loss_vs_time.png", "heatmap_attnres-block.png", "heatmap_dca-2.png"):
        assert (out / plot).stat().st_size > 1000
    assert "vs baseline" in stdout
