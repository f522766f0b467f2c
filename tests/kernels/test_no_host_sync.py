"""No op makes a host-device sync: every op's forward and backward run under mega_depth.training.host_sync's
detector (the CPU stand-in for torch.cuda.set_sync_debug_mode("error")), through the Triton launchers and the
twins. The detector itself catches the pattern that made one sync per mixing call before: a pointer table built
with torch.tensor(list, device=...) (a blocking copy from pageable memory)."""

import os

import pytest
import torch
from kernel_checks import EPS, leaf, sources_of

from mega_depth.kernels import common, fast_functions
from mega_depth.training.host_sync import PACKAGE, SyncDetector, intended


def run_every_op():
    f = fast_functions()
    sources, q, g = sources_of(3, 5, 8), leaf(8), leaf(8, shift=1.0)
    outs = [f.attnres_mix_sources(sources, q, g, EPS, heads=2),
            f.attnres_mix_sources(sources, leaf(5, 8), None, EPS, weight="sigmoid")]
    m, z, o = f.attnres_phase1_sources(sources, leaf(2, 8), leaf(2, 8), EPS)
    outs += [f.attnres_phase2(m[1], z[1], o[1], leaf(5, 8), q, g, EPS), f.attnres_phase2(m[0], z[0], o[0], None, q, g,
                                                                                         EPS)]
    outs.append(f.grn_apply_sources(sources, leaf(3, 8, 3), leaf(3, 8), "v3"))
    outs.append(f.depth_attention_mix(leaf(5, 4, 6), leaf(5, 2, 6), leaf(5, 2, 6), [leaf(5, 2, 6)], [leaf(5, 4, 6)]))
    streams = leaf(4, 5, 8)
    outs += [f.streams_in(streams, leaf(4, 5)), f.streams_out(streams, leaf(5, 8), leaf(4, 5, 4), leaf(4, 5))]
    outs.append(f.sinkhorn(leaf(5, 4, 4), 20, "paper", "deepseek"))
    sum(o.float().sum() for o in outs).backward()


def test_no_op_makes_a_host_sync(path):
    with SyncDetector() as found:
        run_every_op()
    assert not found, "\n".join(map(str, found))


def test_pointer_tables_reach_a_device_without_a_sync():
    """Off the CPU the table goes host -> device with non_blocking=True (the meta device stands in for a GPU)."""
    with SyncDetector() as found:
        table = common.pointer_table([torch.empty(4, device="meta") for _ in range(3)])
    assert table.device.type == "meta" and table.dtype == torch.int64 and table.shape == (3,)
    assert not found, "\n".join(map(str, found))


def test_a_pointer_table_is_made_once_for_the_same_pointers(monkeypatch):
    """A step allocates its activations in the same order every step: a mixing call finds its table made (no pinned
    allocation, copy or event on a GPU's host). The table holds exactly its key's pointers and low bits, the least
    recently used goes past TABLES_KEPT, and a table is right for whatever tensor now lies at its pointers."""
    monkeypatch.setattr(common, "_TABLES", type(common._TABLES)())
    monkeypatch.setattr(common, "TABLES_KEPT", 3)
    a, b = torch.zeros(4), torch.zeros(4)
    first = common.pointer_table([a, b])
    assert common.pointer_table([a, b]) is first and first.tolist() == [a.data_ptr(), b.data_ptr()]
    added = common.gradient_table([a, b], [False, True])  # other low bits: another table
    assert added is not first and added.tolist() == [a.data_ptr(), b.data_ptr() | 1]
    assert common.pointer_table([b, a]).tolist() == [b.data_ptr(), a.data_ptr()]
    common.pointer_table([a])  # a fourth table: the least recently used ([a, b] was used last before the others)
    assert common.pointer_table([a, b]) is not first
    for _ in range(3):  # a table outlives its tensors and serves whatever tensors lie at its pointers later
        c, d = torch.zeros(64), torch.zeros(64)
        assert common.pointer_table([c, d]).tolist() == [c.data_ptr(), d.data_ptr()]
        del c, d


def old_table(tensors, low_bits=None):
    """The pointer table as it was built before: one blocking copy per mixing call on a GPU."""
    bits = low_bits or [False] * len(tensors)
    return torch.tensor([t.data_ptr() | b for t, b in zip(tensors, bits)], dtype=torch.int64,
                        device=tensors[0].device)


def test_a_gpus_sm_count_is_looked_up_once_a_device(monkeypatch):
    """The launchers ask for the SM count at every launch that reduces (and Liger's norm backward at every call):
    one property lookup per device, the current device's for a bare "cuda"."""
    from types import SimpleNamespace

    asked = []

    def properties(index):
        asked.append(index)
        return SimpleNamespace(multi_processor_count={0: 132, 1: 78}[index])

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    common._sm_counts.cache_clear()
    try:
        counts = [common.gpu_sm_count(torch.device(d)) for d in ("cuda:0", "cuda:0", "cuda", "cuda:1", "cuda:0")]
    finally:
        common._sm_counts.cache_clear()
    assert counts == [132, 132, 78, 78, 132] and asked == [0, 1]


def test_the_detector_catches_a_blocking_table_and_host_reads(monkeypatch):
    here = (os.path.dirname(os.path.abspath(__file__)), PACKAGE)
    tensors = [torch.zeros(3) for _ in range(2)]
    with SyncDetector(here) as found:
        old_table(tensors)
        tensors[0].sum().item()
        with intended("a read the caller means"):
            tensors[1].sum().item()
    assert [s.what.split("(")[0] for s in found] == ["torch.tensor", "Tensor.item"], found
    monkeypatch.setattr(common, "pointer_table", old_table)
    for module in ("attnres_mix", "attnres_block", "grn", "depth_attention"):
        monkeypatch.setattr(f"mega_depth.kernels.{module}.pointer_table", old_table)
    monkeypatch.setattr(common, "FORCE_TRITON", True)
    with SyncDetector(here) as found:
        run_every_op()
    assert found and all("torch.tensor" in s.what for s in found)


def test_a_captured_steps_tables_come_from_one_buffer_filled_after_the_capture(monkeypatch):
    """While a step is captured as a CUDA graph (--cuda-graph-impl local), a pinned copy would become a graph node
    that reads a recycled host block at every replay: each table is a slice of one device buffer instead, sized by
    the step before (graph_tables.Counter), at a 16-byte boundary, never kept in the eager cache, and holding its
    pointers once filled after the capture. A capture that makes more entries than the step before fails, naming
    the flag. (Launches recorded: the kernels must not read a table before it is filled.)"""
    from mega_depth.kernels import graph_tables

    monkeypatch.setattr(common, "_TABLES", type(common._TABLES)())
    before = graph_tables.Counter.entries
    with common.recording(132):
        run_every_op()
    entries = graph_tables.Counter.entries - before
    tables = graph_tables.CapturedTables(torch.device("cpu"), entries)
    with common.recording(132) as launches, graph_tables.capturing(tables), SyncDetector() as found:
        run_every_op()
    assert not found, "\n".join(map(str, found))
    assert not common._TABLES  # (recording keeps none either way; the capture's are the buffer's)
    made = [a for launch in launches for a in launch.args
            if isinstance(a, torch.Tensor) and a.dtype == torch.int64 and a._base is tables.buffer]
    assert len(made) >= 10
    tables.fill()
    for table in made:
        assert table.data_ptr() % 16 == 0
        assert all(p != 0 and (p & ~1) % 16 == 0 for p in table.tolist())  # pointers, a gradient table's low bit
    small = graph_tables.CapturedTables(torch.device("cpu"), 3)
    with graph_tables.capturing(small), pytest.raises(RuntimeError, match="--cuda-graph-impl"):
        common.pointer_table([torch.zeros(4) for _ in range(4)])
    assert graph_tables.ACTIVE is None
