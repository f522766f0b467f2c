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
    assert "vs baseline" in stdout
