"""Every Triton kernel the shipped 125M / 1B / 7B configs launch compiles ahead of time for sm_80, sm_90 and sm_100
in bf16 (and for sm_90 in fp32), without a spill and without a global load of 2 bytes or less a thread (a bf16 row
read one value at a time) (tools/kernel_resources.py; mega_depth/kernels/aot.py). No GPU is needed: the launches are
recorded on meta tensors at the configs' real sizes and TP/SP splits, then compiled by Triton for each
target and read with ptxas -v and cuobjdump from the triton wheel."""

import json
import math
import os
import textwrap

import pytest

from fixtures import ROOT, run

pytest.importorskip("triton", reason="triton is not installed (tools/setup.sh installs it with the test extra)")


def test_every_launched_kernel_compiles_for_three_targets_without_a_spill(tmp_path):
    out = tmp_path / "resources.json"
    # bf16 (what the configs train in) for all three targets; fp32 for sm_90 alone (four compile jobs on two cores,
    # not six: a minute less of CI)
    # compiled, not interpreted, whatever a kernel test run earlier in this worker set (kernel_checks)
    proc = run(["tools/kernel_resources.py", "--dtypes", "bf16,fp32:90", "--out", str(out)], expect=None, timeout=2400,
               env={"TRITON_INTERPRET": "0", "MEGA_DEPTH_KERNELS_FORCE_TRITON": "0"})
    rows = json.loads(out.read_text())
    bad = [r for r in rows if r.get("error") or r.get("spill_stores") or r.get("local")]
    assert proc.returncode == 0 and not bad, (proc.stdout[-3000:], bad[:5])
    assert {(r["dtype"], r["target"]) for r in rows} == {("bf16", "sm_80"), ("bf16", "sm_90"), ("bf16", "sm_100"),
                                                          ("fp32", "sm_90")}
    kernels = {r["kernel"].split("(")[0] for r in rows}
    ops = [f[:-3] for f in os.listdir(os.path.join(ROOT, "mega_depth", "kernels"))
           if f[:-3] in ("attnres_mix", "attnres_block", "grn", "depth_attention", "streams", "mhc_maps",
                         "mhc_projection")]  # Sinkhorn's half-steps run inside mhc_maps' kernels
    for op in ops:  # every op module's forward and backward kernels were among the launches
        assert any(k.startswith(f"{op}._fwd") or k.startswith(f"{op}._phase") or k.startswith(f"{op}._in_")
                   for k in kernels), (op, sorted(kernels))
    assert {"attnres_block._phase1_bwd_kernel", "grn._params_kernel", "depth_attention._bwd_kernel",
            "mhc_maps._bwd_kernel", "streams._out_bwd_kernel", "attnres_mix._bwd_kernel",
            "streams._sum_kernel"} <= kernels
    configs = {c.split("-")[0] for r in rows for c in r["configs"]}
    assert configs == {"125m", "1b", "7b"}
    assert all(r["registers"] > 0 and 0 < r["occupancy"] <= 100 for r in rows)
    # the bf16 kernels of the 1B step on an H100 read rows 16 bytes a load (ld.global.v4 or cp.async of 16 bytes),
    # the phase-1 kernels of Block AttnRes included (they read 2 bytes a load before)
    step = [r for r in rows if r["dtype"] == "bf16" and r["target"] == "sm_90" and any(c.startswith("1b-")
                                                                                        for c in r["configs"])]
    assert step and all(r["narrow_loads"] == 0 and r["widest_load"] >= 8 for r in step), step[:3]
    assert all(r["widest_load"] == 16 for r in step if "_phase1_" in r["kernel"]), step
    # DCA's q/k/v GRN (3 instances, chunks of 256 channels) reads a block of sources as one tile: a lone row of 256
    # bf16 channels loaded 4 bytes a thread (ld.global.b32), one source after another. The backward's kernels read
    # rows 16 bytes a load, and fp32 gates 4 (a token's scalars); the sources' gradients are a stream: no barrier,
    # no shared memory (its [tokens, sources, channels] tiles and [tokens, 1, channels] rows laid out alike)
    grn = [(r["kernel"], r["load_widths"]) for r in step if r["kernel"].startswith("grn._fwd_kernel")
           and "BG=4," in r["kernel"] and "KB=1," not in r["kernel"]]
    assert grn and all(min(map(int, widths)) >= 8 and widths.get("16") for k, widths in grn), grn
    backward = [r for r in step if r["kernel"].startswith(("grn._gates_bwd_kernel", "grn._source_grads_kernel"))]
    assert {r["kernel"].split("(")[0] for r in backward} == {"grn._gates_bwd_kernel", "grn._source_grads_kernel"}
    assert all(min(map(int, r["load_widths"])) >= 4 and r["load_widths"].get("16") for r in backward), backward
    assert all(r["barriers"] == 0 and r["shared"] == 0 for r in backward if "_source_grads_" in r["kernel"]), backward
    # loads in flight come from resident warps: every launcher's guess for the 1B step keeps at least 16 an SM
    # (4 blocks of 4, 25 %). Given the whole register file, Block AttnRes's phase-1 kernels and mHC's projection kept
    # 8 (12 %). A program of one warp, which loads its token's whole tile as a wider program does, counts by its
    # programs: at least 8 an SM (Depth-Attention's 1B backward: 10 of one warp, where 8 of two exchanged between
    # their warps through shared memory 73 times a token). A setting the tuner measured faster on that target's GPU
    # (kernels/tuned.json) outranks the rule: on the H200 the AttnRes mix forward ran 1.75x faster at 12 resident
    # warps than at 24.
    guessed = [r for r in rows if r["dtype"] == "bf16" and not r["tuned"] and any(c.startswith("1b-")
                                                                                   for c in r["configs"])]
    assert {r["target"] for r in guessed} == {"sm_80", "sm_90", "sm_100"}

    def resident_enough(row):
        warps = int(row["kernel"].rsplit(" warps=", 1)[1].split("/")[0])
        return row["occupancy"] >= 25 or (warps == 1 and round(row["occupancy"] * 64 / 100) >= 8)

    assert all(map(resident_enough, guessed)), [(r["kernel"], r["target"], r["occupancy"])
                                                for r in guessed if not resident_enough(r)]
    # a launch that moves 32 MB or more has a program for every SM of its target at the 1B and 7B sizes: mHC's
    # projection had 128 programs (7B: 32) for 132 SMs, each walking the four streams in turn
    from mega_depth.kernels.aot import TARGETS

    sms = {f"sm_{t}": spec[0] for t, spec in TARGETS.items()}
    starved = [(r["kernel"], r["target"], r["fewest_programs_of_a_big_launch"]) for r in rows
               if r["dtype"] == "bf16" and any(c.startswith(("1b-", "7b-")) for c in r["configs"])
               and (r["fewest_programs_of_a_big_launch"] or math.inf) < sms[r["target"]]]
    assert not starved, starved
    # every entry of the shipped tuning table is taken by a launch of a shipped config on its target: an entry whose
    # key no launch makes (a constexpr renamed or added since, e.g. phase 2's NORMED) is a measurement of nothing,
    # and 10 such sat in the table until 2026-12-07
    from mega_depth.kernels import tuning

    unmatched = [(t, k) for t, entries in tuning.TABLE.items() for k in entries  # (the table the survey used)
                 if not any(r.get("table_key") == k and r["target"] == t for r in rows)]
    assert not unmatched, unmatched
    # every parameter gradient is reduced in order (per-program partial sums, then common.sum_rows): the same bits
    # every run. AttnRes's kernels, mHC's and the GRNs' (DCA, DenseFormer) added atomically before.
    assert all(r["atomics"] == 0 for r in rows), sorted({(r["kernel"], r["atomics"]) for r in rows if r["atomics"]})


def test_the_load_widths_of_a_kernel_are_read_from_its_ptx():
    """What the narrow-load check counts: the bytes one thread loads per global load instruction."""
    from mega_depth.kernels.aot import load_widths

    ptx = """
        ld.global.b64 { %rd19 }, [ %rd40 + 0 ];
        @%p9 ld.global.b16 { %rs9 }, [ %rd20 + 0 ];
        @!%p2 ld.global.nc.L1::evict_last.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        @%p1 ld.global.v2.b32 { %r1, %r2 }, [ %rd1 + 0 ];
        cp.async.cg.shared.global [ %r214 + 0 ], [ %rd46 + 0 ], 0x10, %r30;
        ld.shared.v4.b16 {%rs1, %rs2, %rs3, %rs4}, [%r49];
        st.global.b16 [ %rd2 + 0 ], { %rs1 };
    """
    assert load_widths(ptx) == {8: 2, 2: 1, 16: 2}


def test_global_atomics_are_counted_in_the_ptx():
    from mega_depth.kernels.aot import global_atomics

    ptx = """
        @%p1 atom.global.gpu.acq_rel.add.f32 %f1, [ %rd1 + 0 ], %f2;
        red.global.add.f32 [ %rd2 + 0 ], %f3;
        atom.shared.add.f32 %f4, [ %r1 + 0 ], %f5;
        ld.global.b32 { %r2 }, [ %rd3 + 0 ];
    """
    assert global_atomics(ptx) == 2


def test_a_spill_or_a_compile_error_fails_the_check():
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from kernel_resources import failures

    ok = {"kernel": "k", "spill_stores": 0, "local": 0, "narrow_loads": 0}
    assert failures([ok]) == []
    assert failures([dict(ok, spill_stores=4)]) and failures([dict(ok, local=8)])
    assert failures([dict(ok, narrow_loads=1)])
    assert failures([{"kernel": "k", "error": "CompilationError: ..."}])


def test_a_tuned_setting_is_what_its_target_compiles():
    """kernels/tuned.json's entry for a kernel and a GPU generation reaches that target's compile (and so the spill
    check above) and no other target's. In a process of its own: the kernel tests' interpreter replaces the JIT
    functions that a compile needs."""
    run(["-c", textwrap.dedent("""
        import torch

        from mega_depth.kernels import aot, common, tuning
        from mega_depth.kernels.streams import streams_out

        with torch.device("meta"):
            args = (torch.zeros(4, 8, 256, dtype=torch.bfloat16), torch.zeros(8, 256, dtype=torch.bfloat16),
                    torch.zeros(4, 8, 4), torch.zeros(4, 8))
        with common.recording(132) as launches:
            streams_out(*args)
        (launch,) = launches
        key = tuning.key(launch.kernel, launch.args, launch.constexprs)
        assert key == "streams._out_fwd_kernel(BD=256, BN=4, NS=4) bf16,fp32", key
        tuning.TABLE = {"sm_90": {key: (2, 32)}}
        tuned = aot.compile_launch(launch, 90)
        assert tuned.num_warps == 2, tuned.num_warps
        assert aot.resources(tuned, 90)["registers"] <= 64  # 32 resident warps: 64 registers a thread
        assert aot.compile_launch(launch, 80).num_warps == launch.num_warps == 4, launch.num_warps
    """)], env={"TRITON_INTERPRET": "0", "MEGA_DEPTH_KERNELS_FORCE_TRITON": "0"}, timeout=300)


def test_a_launch_takes_the_table_entry_of_its_own_specialisation(monkeypatch):
    """common.launch looks its setting up by a cheap key (tuning.launch_setting) and gets what tuning.setting gives:
    the entry of the kernel, constexprs and dtypes on the running GPU, the guess for another dtype, a new table's
    entry once the table is replaced, a forced candidate while forcing. It looks up only a kernel that the table
    (the current one) has an entry for, on any target, or while the tuner forces or observes (tuning.active)."""
    import torch

    from mega_depth.kernels import common, tuning
    from mega_depth.kernels.streams import streams_out

    def launched(dtype):
        with torch.device("meta"):
            args = (torch.zeros(4, 8, 256, dtype=dtype), torch.zeros(8, 256, dtype=dtype), torch.zeros(4, 8, 4),
                    torch.zeros(4, 8))
        with common.recording(132) as launches:
            streams_out(*args)
        return launches[0]

    bf16, fp32 = launched(torch.bfloat16), launched(torch.float32)
    monkeypatch.setattr(tuning, "_running_target", lambda args: "sm_90")
    monkeypatch.setattr(tuning, "TABLE", {"sm_90": {tuning.key(bf16.kernel, bf16.args, bf16.constexprs): (2, 32)}})
    from mega_depth.kernels.streams import _in_fwd_kernel  # a kernel of the same op module, with no entry
    assert tuning.active(bf16.kernel) and not tuning.active(_in_fwd_kernel)
    monkeypatch.setattr(tuning, "TABLE", {"sm_80": {"streams._in_fwd_kernel(BD=256) bf16": (4, 16)}})
    assert tuning.active(_in_fwd_kernel) and not tuning.active(bf16.kernel)
    with tuning.observing():
        assert tuning.active(bf16.kernel)
    monkeypatch.setattr(tuning, "TABLE", {})
    assert not tuning.active(bf16.kernel) and not tuning.active(_in_fwd_kernel)
    monkeypatch.setattr(tuning, "TABLE", {"sm_90": {tuning.key(bf16.kernel, bf16.args, bf16.constexprs): (2, 32)}})

    def chosen(launch):
        return tuning.launch_setting(launch.kernel, launch.args, launch.constexprs, (launch.num_warps, 16))

    assert chosen(bf16) == chosen(bf16) == (2, 32) and chosen(fp32) == (fp32.num_warps, 16)
    monkeypatch.setattr(tuning, "TABLE", {"sm_90": {tuning.key(fp32.kernel, fp32.args, fp32.constexprs): (8, 8)}})
    assert chosen(bf16) == (bf16.num_warps, 16) and chosen(fp32) == (8, 8)
    with tuning.forcing({tuning.key(fp32.kernel, fp32.args, fp32.constexprs): (1, 64)}):
        assert chosen(fp32) == (1, 64)
    assert chosen(fp32) == (8, 8)


def test_a_malformed_tuning_table_names_the_fix(tmp_path):
    from mega_depth.kernels import tuning

    bad = tmp_path / "tuned.json"
    bad.write_text('{"sm_90": {"streams._out_fwd_kernel(BD=256) bf16": [8]}}')
    with pytest.raises(ValueError, match="not \\[warps, resident warps\\].*bench_kernels.py --tune"):
        tuning.load(str(bad))
    bad.write_text('{"h100": {}}')
    with pytest.raises(ValueError, match="not a target like 'sm_90'"):
        tuning.load(str(bad))
    assert tuning.load(str(tmp_path / "absent.json")) == {}


def test_a_table_named_in_the_environment_replaces_the_shipped_one(tmp_path):
    """MEGA_DEPTH_TUNED_TABLE: a table a tuning run just wrote is measured (device_check's kernels_tuned step)
    before it is committed; a name that is no file stops the import with the fix, never falls back silently."""
    import subprocess
    import sys

    table = tmp_path / "tuned.json"
    table.write_text('{"sm_90": {"streams._out_fwd_kernel(BD=256) bf16": [2, 8]}}')
    probe = "from mega_depth.kernels import tuning; print(tuning.TABLE)"
    env = dict(os.environ, PYTHONPATH=ROOT, MEGA_DEPTH_TUNED_TABLE=str(table))
    found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert found.stdout.strip() == "{'sm_90': {'streams._out_fwd_kernel(BD=256) bf16': (2, 8)}}", found.stderr
    env["MEGA_DEPTH_TUNED_TABLE"] = str(tmp_path / "absent.json")
    missing = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "no such file" in missing.stderr and "unset it" in missing.stderr


def test_pipelined_loops_can_be_switched_off_for_a_gpu_run_to_time_both_ways():
    """MEGA_DEPTH_KERNELS_PIPELINE=0 (device_check's kernels_unpipelined): every pipelined loop back to one step's
    loads at a time, the launchers' stage arguments included (read at import, so in a process of its own): the
    AttnRes mix backward is launched with STAGES 1 there and 2 by default, and the streams' gradient sum with mHC's
    projection with no STAGES (the loop as Triton pipelines it by itself) and its 128-byte channel chunks there, 2
    stages and 256-byte chunks by default (bf16); HC's sum (no projection) with none either way."""
    import subprocess
    import sys

    probe = textwrap.dedent("""
        import torch
        from mega_depth.kernels import common
        from mega_depth.kernels.attnres_mix import attnres_mix_backward_into_op, attnres_mix_op
        srcs = [torch.randn(4, 64) for _ in range(3)]
        q, g = torch.randn(64), torch.ones(64)
        out, lse = attnres_mix_op(srcs, q, g, 1e-6, False, 1)
        with common.recording(132) as launches:
            attnres_mix_backward_into_op(torch.randn_like(out), srcs, [torch.zeros(4, 64) for _ in srcs],
                                         [False] * 3, q, g, out, lse, 1e-6, False, 1)
        mix = [l for l in launches if l.kernel.__name__ == "_bwd_kernel"][0]
        from mega_depth.kernels.streams import sum_into
        s, m = torch.randn(4, 8, 256, dtype=torch.bfloat16), 24
        with common.recording(132) as launches:
            sum_into(torch.empty_like(s), False, s, write=(torch.randn_like(s), torch.rand(4, 8, 4)))
            sum_into(torch.empty_like(s), False, s, proj=(torch.randn(8, m), torch.randn(8),
                                                          torch.randn(m, 1024, dtype=torch.bfloat16)), phi_grad=True)
        hc, mhc = [l.constexprs for l in launches if l.kernel.__name__ == "_sum_kernel"]
        print(int(common.STREAM_STAGES), int(common.STREAM_PAIR), mix.constexprs["STAGES"], hc["STAGES"],
              mhc["STAGES"], mhc["BC"])
    """)
    found = {}
    for switch in ("1", "0"):
        env = dict(os.environ, PYTHONPATH=ROOT, MEGA_DEPTH_KERNELS_PIPELINE=switch, TRITON_INTERPRET="0")
        proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        found[switch] = proc.stdout.split()[-6:] if proc.returncode == 0 else proc.stderr[-2000:]
    assert found == {"1": ["3", "2", "2", "None", "2", "128"], "0": ["1", "1", "1", "None", "None", "64"]}, found


def test_every_tuned_setting_names_a_kernel_that_exists():
    """An entry of kernels/tuned.json whose kernel was rewritten away is a setting no launch takes: the table would
    claim measurements of code that is gone (the GRN's whole-row backward, 2026-12-07). Each key's op module must
    hold its kernel as a Triton JIT function; rewriting a kernel means retuning it (tools/bench_kernels.py --tune)."""
    import importlib

    from mega_depth.kernels import tuning

    table = tuning.load(tuning.SHIPPED_PATH)
    assert table, "the shipped table is empty"
    gone = []
    for target, entries in table.items():
        for key in entries:
            module, kernel = key.split("(")[0].split(".")
            if not hasattr(getattr(importlib.import_module(f"mega_depth.kernels.{module}"), kernel, None), "fn"):
                gone.append((target, key))
    assert not gone, gone
