"""common.sum_rows, the in-order reduction of every parameter gradient's per-program partial sums: equal to the sum
in fp64, the same bits on a second run, and the tiles that the compiled kernel uses (many programs over the
columns, few steps over the rows)."""

import contextlib

import pytest
import torch

import kernel_checks  # noqa: F401  (TRITON_INTERPRET before triton is imported)
from mega_depth.kernels import common


@pytest.mark.parametrize("rows, cols", [(1, 5), (3, 16), (7, 33), (130, 48)])
def test_the_partial_sums_add_up_in_a_fixed_order(rows, cols, monkeypatch):
    monkeypatch.setattr(common, "FORCE_TRITON", True)  # the Triton kernel on CPU tensors, under the interpreter
    parts = torch.randn(rows, cols)
    got, again = common.sum_rows(parts), common.sum_rows(parts)
    assert torch.allclose(got.double(), parts.double().sum(0), rtol=1e-6, atol=1e-5), got
    assert torch.equal(got, again)
    assert torch.equal(common.sum_rows(parts, cols - 1), got[:cols - 1])


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sum_times_each_scale_in_one_call(path, dtype, monkeypatch):
    """A folded query's gradient is the sum times the gain and the sum times the query: both from one call, equal
    to the products in fp32 of the plain sum (the scales cover the first `cols` columns only)."""
    monkeypatch.setattr(common, "FORCE_TRITON", path == "triton")
    rows, width, cols = 7, 48, 40
    parts = torch.randn(rows, width)
    gain, query = torch.randn(cols).to(dtype), torch.randn(cols).to(dtype)
    total = common.sum_rows(parts, cols)
    by_gain, by_query = common.sum_rows(parts, cols, (gain, query))
    assert torch.equal(by_gain, total * gain.float()) and torch.equal(by_query, total * query.float())
    (alone,) = common.sum_rows(parts, cols, (gain,))
    assert torch.equal(alone, by_gain) and alone.dtype == torch.float32 and alone.shape == (cols,)
    # rounded once to the parameters' dtype, as a cast after the fp32 product would (a GPU rounds to nearest, as
    # torch does; Triton's interpreter truncates to bf16: one rounding step apart there)
    rounded = common.sum_rows(parts, cols, (gain, query), (dtype, torch.float32))
    plain = common.sum_rows(parts, cols, dtypes=[dtype])
    assert rounded[0].dtype == plain.dtype == dtype and torch.equal(rounded[1], by_query)
    step = 2 ** -7 if path == "triton" and dtype == torch.bfloat16 else 0
    torch.testing.assert_close(rounded[0].float(), by_gain.to(dtype).float(), rtol=step, atol=0)
    torch.testing.assert_close(plain.float(), total.to(dtype).float(), rtol=step, atol=0)
    with pytest.raises(ValueError, match="2 scales but 1 dtypes"):
        common.sum_rows(parts, cols, (gain, query), (dtype,))


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("scaled", [False, True])
def test_a_tail_of_columns_is_a_second_sum_from_the_same_launch(path, scaled, monkeypatch):
    """Two gradients' partial sums side by side in one row ([head | tail], the tail from a multiple of 16): one
    call returns the head's sum (scaled, as without a tail) and the tail's own sum, unscaled, in its dtype; the
    padding columns between them reach neither. One launch on the Triton path."""
    monkeypatch.setattr(common, "FORCE_TRITON", path == "triton")
    rows, cols, start, tail_cols = 9, 20, 32, 13
    parts = torch.randn(rows, start + 16)
    gain, query = torch.randn(cols), torch.randn(cols)
    scales = (gain, query) if scaled else ()
    alone = common.sum_rows(parts[:, :start].contiguous(), cols, scales)
    with common.recording(132) if path == "triton" else contextlib.nullcontext() as launches:
        if path == "triton":  # what the call launches
            common.sum_rows(parts, cols, scales, tail=(start, tail_cols, torch.bfloat16))
            assert len(launches) == 1
    head, tail = common.sum_rows(parts, cols, scales, tail=(start, tail_cols, torch.bfloat16))
    for a, b in zip(head if scaled else [head], alone if scaled else [alone]):
        assert torch.equal(a, b) and a.shape == (cols,)
    assert tail.dtype == torch.bfloat16 and tail.shape == (tail_cols,)
    step = 2 ** -7 if path == "triton" else 0  # (the interpreter truncates to bf16: one rounding step)
    torch.testing.assert_close(tail.float(), parts[:, start:start + tail_cols].sum(0).to(torch.bfloat16).float(),
                               rtol=step, atol=1e-6)
    with pytest.raises(ValueError, match="does not fit"):
        common.sum_rows(parts, cols, tail=(24, 4, torch.float32))  # not a multiple of 16


def test_the_compiled_tiles_spread_the_columns_over_programs(monkeypatch):
    """The 1B step's usual reduction, 1,056 partial rows of 2,048 columns: 128 programs of 5 dependent steps (it
    was 2 programs of 1,056 dependent row loads, then 32 of 17); few rows take wide column chunks, narrowed to 32
    columns where the chunks leave SMs idle; a step is at most SUM_TILE values."""
    monkeypatch.setattr(common, "_INTERPRETING", False)
    assert common._sum_rows_blocks(1056, 2048) == (256, 16)
    assert common._sum_rows_blocks(8, 196608) == (8, 512)
    assert common._sum_rows_blocks(1056, 32) == (256, 16)
    assert common._sum_rows_blocks(3, 8) == (4, 16)
    # a 7B sublayer's query and norm-weight partial sums side by side: 8,192 columns, 512 programs
    assert common._sum_rows_blocks(1056, 8192, 132) == (256, 16)
    # 64 rows: chunks of 64 columns would make 32 programs for 132 SMs, of 32 columns 64
    assert common._sum_rows_blocks(64, 2048, 132) == (64, 32)
    assert common._sum_rows_blocks(64, 2048 * 132, 132) == (64, 64)
    assert common._sum_rows_blocks(8, 196608, 132) == (8, 512)
    for p, k in [(1056, 2048), (8, 196608), (1, 1), (5000, 7)]:
        br, bk = common._sum_rows_blocks(p, k)
        assert br * bk <= common.SUM_TILE and bk >= 16 and br <= common.SUM_ROWS
