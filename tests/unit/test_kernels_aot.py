"""Every Triton kernel the shipped 125M / 1B / 7B configs launch compiles ahead of time for sm_80, sm_90 and sm_100,
in bf16 and fp32, without a spill (tools/kernel_resources.py; mega_depth/kernels/aot.py). No GPU is needed: the
launches are recorded on meta tensors at the configs' real sizes and TP/SP splits, then compiled by Triton for each
target and read with ptxas -v and cuobjdump from the triton wheel."""

import json
import os

import pytest

from fixtures import ROOT, run

pytest.importorskip("triton", reason="triton is not installed (tools/setup.sh installs it with the test extra)")


def test_every_launched_kernel_compiles_for_three_targets_without_a_spill(tmp_path):
    out = tmp_path / "resources.json"
    proc = run(["tools/kernel_resources.py", "--out", str(out)], expect=None, timeout=2400)
    rows = json.loads(out.read_text())
    bad = [r for r in rows if r.get("error") or r.get("spill_stores") or r.get("local")]
    assert proc.returncode == 0 and not bad, (proc.stdout[-3000:], bad[:5])
    assert {r["target"] for r in rows} == {"sm_80", "sm_90", "sm_100"}
    assert {r["dtype"] for r in rows} == {"bf16", "fp32"}
    kernels = {r["kernel"].split("(")[0] for r in rows}
    ops = [f[:-3] for f in os.listdir(os.path.join(ROOT, "mega_depth", "kernels"))
           if f[:-3] in ("attnres_mix", "attnres_block", "grn", "depth_attention", "streams", "sinkhorn")]
    for op in ops:  # every op module's forward and backward kernels were among the launches
        assert any(k.startswith(f"{op}._fwd") or k.startswith(f"{op}._phase") or k.startswith(f"{op}._in_")
                   for k in kernels), (op, sorted(kernels))
    assert {"attnres_block._phase1_bwd_kernel", "grn._params_kernel", "depth_attention._bwd_kernel",
            "sinkhorn._bwd_kernel", "streams._out_bwd_kernel", "attnres_mix._bwd_kernel"} <= kernels
    configs = {c.split("-")[0] for r in rows for c in r["configs"]}
    assert configs == {"125m", "1b", "7b"}
    assert all(r["registers"] > 0 and 0 < r["occupancy"] <= 100 for r in rows)


def test_a_spill_or_a_compile_error_fails_the_check():
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from kernel_resources import failures

    ok = {"kernel": "k", "spill_stores": 0, "local": 0}
    assert failures([ok]) == []
    assert failures([dict(ok, spill_stores=4)]) and failures([dict(ok, local=8)])
    assert failures([{"kernel": "k", "error": "CompilationError: ..."}])
