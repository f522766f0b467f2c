"""tools/bench_kernels.py at toy size under the interpreter: every op runs on our kernels and is checked against
the eager math, and every peer that can run on a CPU is checked against ours (the GPU run times them)."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import bench_kernels  # noqa: E402
from kernel_peers import Peer  # noqa: E402


def test_the_toy_run_checks_every_op_and_the_peers_that_run_on_a_cpu(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert bench_kernels.main(["--toy", "--out", str(out), "--markdown"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| attnres_mix | toy |")]
    assert table and all(line.count("|") == 11 for line in table), table
    found = json.loads(out.read_text())
    status = {(r["op"], r["impl"]): r["status"] for r in found["rows"]}
    assert {op for op, impl in status if impl == "mega_depth"} == set(bench_kernels.OPS)
    assert all(s == "ok" for (op, impl), s in status.items() if impl == "mega_depth")
    assert all(r["deterministic"] for r in found["rows"] if r["impl"] == "mega_depth")
    # the peers that run under the interpreter compute our function; fla's kernels need CUDA tensors
    for peer in (("attnres_mix", "liger attn_res"), ("attnres_block", "flash-attn-res"),
                 ("phase2", "flash-attn-res phase 2"), ("streams_out", "liger mhc_post_res"),
                 ("mhc_projection", "liger mhc_mm_norm")):
        assert status[peer].startswith("equal"), (peer, status[peer])
    assert status[("attnres_mix", "fla fused_attnres")].startswith("skipped") and "CUDA" in \
        status[("attnres_mix", "fla fused_attnres")]
    assert all(r["fwd_s"] is None for r in found["rows"])  # nothing is timed on a CPU
    # the launch references ran (Triton's launcher with the arguments common.sum_rows passes, under the
    # interpreter), untimed here
    assert found["references"]["toy"] == {"copy_GBps": None, "sum8_GBps": None, "torch_add_host_us": None,
                                          "triton_launch_host_us": None, "sum_rows_host_us": None}


def test_the_kernel_breakdown_lists_each_phases_kernels():
    """--kernel-breakdown: one call of each phase under torch.profiler, its kernels (on a GPU; on a CPU the top-level
    operators) with their time and launches, longest first; the table's rows after the main table."""
    (case,) = [c for c in bench_kernels.cases("toy", torch.float32, torch.device("cpu"), toy=True) if c.op == "grn"]
    found = bench_kernels.kernel_breakdown(case.run, case.make(), torch.device("cpu"))
    fwd, bwd = found["fwd_kernels"], found["bwd_kernels"]
    assert fwd[0][0] == "mega_depth::dca_grn" and fwd[0][2] == 1, fwd
    assert [e[1] for e in bwd] == sorted((e[1] for e in bwd), reverse=True) and all(e[2] >= 1 for e in bwd), bwd
    assert "Backward" in bwd[0][0], bwd
    table = bench_kernels.breakdown_markdown([dict(op="grn", shape="toy", **found)])
    assert "| grn | toy | fwd | `mega_depth::dca_grn` " in table and "| grn | toy | bwd |" in table


def test_a_gradient_the_math_makes_zero_is_compared_to_the_largest_gradient():
    """Both implementations give rounding noise for a gradient that is zero but for an epsilon (phase 2 normed at one
    depth head: z's, the case's `near_zero`): it is held to GRADIENT_FLOOR of the largest gradient, not to its own
    scale. Noise in the largest gradient's range still fails it, and every other gradient keeps its own scale: a
    row's gradient beside a parameter's summed over many tokens is not waved through."""
    big, zero, row = torch.randn(64) * 1e4, torch.zeros(8), torch.randn(8)
    assert bench_kernels.first_difference([big], [big, zero + 1e-9], [big], [big, zero - 1e-9], 1e-4, (1,)) is None
    assert "gradient 1" in bench_kernels.first_difference([big], [big, zero - 1e-9], [big], [big, zero + 1e-9], 1e-4)
    assert "gradient 1" in bench_kernels.first_difference([big], [big, zero + 10.], [big], [big, zero], 1e-4, (1,))
    assert "gradient 1" in bench_kernels.first_difference([big], [big, row * 1.01], [big], [big, row], 1e-4, (0,))
    (normed,) = [c for c in bench_kernels.cases("toy", torch.float32, torch.device("cpu"), toy=True)
                 if c.op == "phase2_normed"]
    assert normed.near_zero == (1,)  # z's gradient: inputs m, z, o, x, query, gain, norm weight


def clock_events(clock, on_sync=lambda: None):
    """A fake torch.cuda.Event on a fake device clock (clock[0], seconds); on_sync runs at an event's sync."""
    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = clock[0]

        def synchronize(self):
            on_sync()

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    return Event


def test_a_timing_is_a_series_of_calls_without_a_sync_between_them(monkeypatch):
    """timed() on a GPU, with a fake device clock: the calls of a series are queued back to back (a sync after
    each would add the host's launch time to the device's), a call's time is the series' over its calls, and the
    median series counts."""
    clock, calls_since_sync, series_lengths = [0.0], [0], []
    per_call = iter([1e-3] * 3 + [2e-3] * 4 + [9e-3] * 4 + [3e-3] * 4)  # warm-up, then three series

    def on_sync():
        series_lengths.append(calls_since_sync[0])
        calls_since_sync[0] = 0

    def call():
        clock[0] += next(per_call)
        calls_since_sync[0] += 1

    monkeypatch.setattr(torch.cuda, "Event", clock_events(clock, on_sync))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls_since_sync.__setitem__(0, 0))
    # (no graph here: the series time stands where the calls cannot be captured)
    monkeypatch.setattr(bench_kernels, "graphed_seconds", lambda fn, device, repeats: (None, "not captured: x"))
    timing = bench_kernels.timed(call, torch.device("cuda"), 4)
    assert series_lengths == [4, 4, 4]
    assert abs(timing.seconds - 3e-3) < 1e-12 and timing.host_seconds >= 0 and timing.host_profile is None
    assert timing.series_seconds == timing.seconds and timing.graphed == "not captured: x"
    # --host-profile: one more series, under the profiler, after the timed ones
    per_call = iter([1e-3] * 3 + [2e-3] * 4 + [9e-3] * 4 + [3e-3] * 4 + [5e-3] * 4)
    monkeypatch.setattr(bench_kernels, "HOST_PROFILE", True)
    timing = bench_kernels.timed(call, torch.device("cuda"), 4)
    assert abs(timing.seconds - 3e-3) < 1e-12
    assert {name.split("(")[-1]: calls for name, calls, _ in timing.host_profile}["call)"] == 1


def test_a_calls_device_time_is_a_cuda_graph_replay_of_the_series(monkeypatch):
    """The series measured the host where it lagged the device (every op of ours on the H200); the device's time
    is a CUDA graph of the same calls replayed (fake clock and graph: a captured call runs nothing until a replay,
    which runs them back to back at the device's pace). A call that cannot be captured leaves the series time,
    with the reason."""
    import contextlib

    clock, captured, capturing = [0.0], [], [False]

    class Graph:
        def replay(self):
            for run in captured:
                run()

    class Stream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(g, pool, stream, capture_error_mode):
        capturing[0] = True
        yield
        capturing[0] = False

    def call():
        if capturing[0]:  # recorded, not run: the device runs it at replay, 1 ms a call
            captured.append(lambda: clock.__setitem__(0, clock[0] + 1e-3))
        else:  # eagerly the host sets the pace: 5 ms a call
            clock[0] += 5e-3

    for name, value in (("Event", clock_events(clock)), ("CUDAGraph", Graph), ("Stream", Stream), ("graph", graph),
                        ("synchronize", lambda: None), ("current_stream", lambda: Stream()),
                        ("set_stream", lambda stream: None), ("graph_pool_handle", lambda: "pool")):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(bench_kernels, "_POOL", None)
    timing = bench_kernels.timed(call, torch.device("cuda"), 4)
    assert len(captured) == 4 and timing.graphed == "yes"
    assert abs(timing.seconds - 1e-3) < 1e-12 and abs(timing.series_seconds - 5e-3) < 1e-12

    def syncs():
        if capturing[0]:
            raise RuntimeError("operation not permitted when stream is capturing")
        clock[0] += 5e-3

    timing = bench_kernels.timed(syncs, torch.device("cuda"), 4)
    assert timing.graphed.startswith("not captured: RuntimeError: operation not permitted")
    assert abs(timing.seconds - 5e-3) < 1e-12


def test_host_profile_says_where_the_host_time_of_a_call_went():
    """--host-profile: the functions a call spends its host time in, by own time, counted per call (the GPU
    machine's launch path, which the development VM records instead of running)."""
    def slow():
        sum(range(20000))

    def call():
        slow()
        slow()

    profile = bench_kernels.host_profile(call, repeats=3)
    names = {name.split("(")[-1].rstrip(")"): (calls, us) for name, calls, us in profile}
    assert names["slow"][0] == 2 and names["call"][0] == 1, profile
    assert [us for _, _, us in profile] == sorted((us for _, _, us in profile), reverse=True)  # by own time


def test_the_shared_sources_gradients_are_added_in_turn_and_the_deferred_case_sums_them_at_their_sinks(monkeypatch):
    """attnres_mix_shared times the default (model/base.DEFER_READERS: the sinks sum nothing), attnres_mix_deferred
    the same mixes with each source's gradient summed over its readers at once: the same run compares the two."""
    from mega_depth.kernels import attnres_mix
    from mega_depth.model import base

    sums = []
    for name in ("_triton_source_grad", "_torch_source_grad"):  # whichever the op dispatches to here
        summed = getattr(attnres_mix, name)
        monkeypatch.setattr(attnres_mix, name, lambda *a, _summed=summed: sums.append(1) or _summed(*a))
    default = base.DEFER_READERS
    for op, sums_at_sinks in (("attnres_mix_shared", False), ("attnres_mix_deferred", True)):
        case = next(c for c in bench_kernels.cases("toy", torch.float32, torch.device("cpu"), toy=True) if c.op == op)
        sums.clear()
        with case.within():
            row = bench_kernels.measure_ours(case, torch.device("cpu"), 1, 1e-4)
        assert row["status"] == "ok" and bool(sums) == sums_at_sinks, (op, row, len(sums))
        assert base.DEFER_READERS == default  # the case's setting is undone


def test_a_peer_that_computes_another_function_is_reported_and_not_timed():
    case = next(c for c in bench_kernels.cases("toy", torch.float32, torch.device("cpu"), toy=True)
                if c.op == "attnres_mix")
    case.peers = {"off by 1 %": Peer(lambda *a: case.run(*a) * 1.01)}
    rows = bench_kernels.measure(case, torch.device("cpu"), 1, 1e-4)
    assert rows[0]["status"] == "ok" and rows[1]["status"].startswith("differs"), rows


def test_our_op_that_differs_from_the_eager_math_is_reported_and_the_table_goes_on():
    case = next(c for c in bench_kernels.cases("toy", torch.float32, torch.device("cpu"), toy=True)
                if c.op == "attnres_mix")
    run = case.run
    case.run, case.peers = (lambda *a: run(*a) * 1.01), {}
    rows = bench_kernels.measure(case, torch.device("cpu"), 1, 1e-4)
    assert rows[0]["status"].startswith("differs from the fp32 eager math: output"), rows


def test_an_op_whose_second_run_gives_other_bits_is_reported_not_deterministic():
    """What an atomic sum does on a GPU (its order, and fp32 rounding, changes from run to run), here as a last-bit
    change a call: the row says so."""
    case = next(c for c in bench_kernels.cases("toy", torch.float32, torch.device("cpu"), toy=True)
                if c.op == "attnres_mix")  # the cheapest toy case under the interpreter (grn's takes ~25 s)
    run, calls = case.run, [0]

    def drifting(*inputs):
        calls[0] += 1
        return run(*inputs) * (1 + 1e-6 * calls[0])
    case.run, case.peers = drifting, {}
    rows = bench_kernels.measure(case, torch.device("cpu"), 1, 1e-4)
    assert rows[0]["deterministic"] is False and "not deterministic" in rows[0]["status"], rows


def test_the_tuner_launches_every_candidate_setting_and_checks_it(tmp_path):
    """--tune at toy size: each kernel of the op, forward and backward, runs at the launcher's guess and each
    neighbour (the tuner stops if a forced setting does not reach the launch, or a result differs); on a CPU
    nothing is timed, so no winner is named and no table is written."""
    from mega_depth.kernels import tuning

    table = tmp_path / "tuned.json"
    assert bench_kernels.main(["--toy", "--tune", str(table), "--ops", "attnres_mix,streams_out"]) == 0
    rows = json.loads((tmp_path / "tuned.json.rows.json").read_text())["rows"]
    kernels = {(r["op"], r["phase"], r["kernel"].split("(")[0]) for r in rows}
    assert kernels == {("attnres_mix", "fwd", "attnres_mix._fwd_kernel"),
                       ("attnres_mix", "bwd", "attnres_mix._bwd_kernel"),
                       ("attnres_mix", "bwd", "common._sum_rows_kernel"),  # the query's gradient, in order
                       ("streams_out", "fwd", "streams._out_fwd_kernel"),
                       ("streams_out", "bwd", "streams._out_bwd_kernel")}
    for r in rows:
        assert list(r["tried"]) == [str(c) for c in tuning.candidates(tuple(r["guess"]))], r
        assert len(r["tried"]) >= 4 and all(t is None for t in r["tried"].values()), r  # ran, untimed
        assert "best" not in r
    assert not table.exists()


def test_the_tuner_passes_over_a_candidate_whose_compile_spills(tmp_path, monkeypatch):
    """A GPU's compile reports its spills (Triton's n_spills); the tuner names a spilling candidate and never times
    or picks it. Here the compiles at a register cap for 32 resident warps report 240 B."""
    from types import SimpleNamespace

    from mega_depth.kernels import tuning

    report = tuning.launched

    def spilling_at_32_resident(compiled):
        forced = next(iter(tuning._FORCED.values()), None)
        report(SimpleNamespace(n_spills=240) if forced and forced[1] >= 32 else compiled)
    monkeypatch.setattr(tuning, "launched", spilling_at_32_resident)
    table = tmp_path / "tuned.json"
    assert bench_kernels.main(["--toy", "--tune", str(table), "--ops", "streams_out"]) == 0
    rows = json.loads((tmp_path / "tuned.json.rows.json").read_text())["rows"]
    assert any(result == "spills 240 B" for r in rows for result in r["tried"].values()), rows
    for r in rows:
        for candidate, result in r["tried"].items():
            assert result == ("spills 240 B" if int(candidate.strip("()").split(",")[1]) >= 32 else None), r


def test_host_time_of_every_op_is_measured_with_the_launches_recorded(tmp_path):
    """--host: the host's time to issue each op's forward and backward, on the CPU, at the 1B counts of sources,
    heads and streams; the kernels are recorded, not run (under the interpreter they would take seconds)."""
    out = tmp_path / "host.json"
    assert bench_kernels.main(["--host", "--shapes", "1b", "--repeats", "5", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == list(bench_kernels.OPS)
    assert all(0 < r["fwd_host_s"] < 0.1 and 0 < r["bwd_host_s"] < 0.1 for r in rows), rows


def test_the_tuner_times_candidates_in_rounds_and_removes_an_entry_its_guess_beats(tmp_path, monkeypatch):
    """On a stand-in GPU whose first timing of each kernel runs 60 % slow (the H200 tuner of 2026-11-30 timed the
    guess first, once, and found it slower in 30 of 35 rows): the rounds put another candidate first each round and
    take the median, so a guess as fast as its neighbours stays. A table entry that replaced the guess is timed
    beside it; where the guess is the faster, the entry is removed and the table's other entries are kept."""
    from mega_depth.kernels import tuning

    with tuning.observing() as seen:  # the toy streams_out kernels' keys, and the launcher's guesses
        case = next(c for c in bench_kernels.cases("toy", torch.float32, torch.device("cpu"), toy=True)
                    if c.op == "streams_out")
        leaves = [t.detach().requires_grad_() for t in case.make()]
        out = case.run(*leaves)
        torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
    guesses = dict(seen)
    fwd = next(k for k in guesses if "_out_fwd_" in k)
    bwd = next(k for k in guesses if "_out_bwd_" in k)
    entry = next(c for c in tuning.candidates(guesses[fwd]) if c != guesses[fwd])  # shipped in place of the guess
    table = tmp_path / "tuned.json"
    table.write_text(json.dumps({"sm_90": {fwd: list(entry), "other._kernel(B=1) bf16": [4, 16]}}))
    monkeypatch.setattr(tuning, "TABLE", {"sm_90": {fwd: entry}})
    monkeypatch.setattr(tuning, "_running_target", lambda args: "sm_90")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    timings = {}

    def stand_in(fn, device, repeats, series=True):
        fn()
        (key, setting), = tuning._FORCED.items()
        first = key not in timings
        timings.setdefault(key, []).append(setting)
        seconds = 1.0 if setting == guesses[key] else 2.0 if setting == entry else 1.2
        return bench_kernels.Timing(seconds * (1.6 if first else 1.0), float("nan"), float("nan"), "yes")
    monkeypatch.setattr(bench_kernels, "timed", stand_in)
    assert bench_kernels.main(["--toy", "--tune", str(table), "--ops", "streams_out"]) == 0
    rows = {r["kernel"]: r for r in json.loads((tmp_path / "tuned.json.rows.json").read_text())["rows"]}
    assert rows[bwd]["tried"][str(guesses[bwd])] == 1.0 and "best" not in rows[bwd], rows[bwd]
    assert len(rows[bwd]["rounds"][str(guesses[bwd])]) == bench_kernels.TUNE_ROUNDS
    assert timings[bwd][0] == guesses[bwd] and timings[bwd][len(rows[bwd]["rounds"])] != guesses[bwd]
    assert rows[fwd]["shipped"] == list(entry) and rows[fwd]["best"] == list(guesses[fwd]), rows[fwd]
    assert len(rows[fwd]["rounds"][str(entry)]) == bench_kernels.TUNE_ROUNDS  # a candidate too: once a round
    assert json.loads(table.read_text()) == {"sm_90": {"other._kernel(B=1) bf16": [4, 16]}}
    assert fwd not in tuning.TABLE["sm_90"]  # the ops after launch what was written
