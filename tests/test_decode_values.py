"""Values of torch.ops.ple.disk_gather: equal to torch's own conversion of the
same rows, for every row format and output dtype.

Tables are written with the ``safetensors`` package; the reference is computed
from the tensors written, never from ple.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ple
from helpers import dtype_id, take_rows

COLS = 16
ROWS = (97, 97, 77)  # three shards, 271 rows
OUT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, None]
SCALED = (torch.float8_e4m3fn, torch.uint8, torch.int8)
FORMATS = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8_e4m3fn",
    torch.uint8: "u8",
    torch.int8: "i8",
}


def table_values(dtype: torch.dtype, rows: int, cols: int = COLS, seed: int = 0) -> torch.Tensor:
    """``rows x cols`` values of ``dtype``.  One-byte formats hold every one of
    their 256 bit patterns; the floats hold specials (inf, nan, -0, subnormals,
    values beyond the float16 range) as well as random values."""
    gen = torch.Generator().manual_seed(seed)
    n = rows * cols
    if dtype.itemsize == 1:
        bits = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        bits[:256] = torch.arange(256, dtype=torch.uint8)
        return bits.view(dtype).reshape(rows, cols)
    # Random bit patterns, half of them, and random normal values of a wide range.
    if dtype == torch.float32:
        bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int32)
        values = bits.view(torch.float32).clone()
    else:
        bits = torch.randint(-2**15, 2**15 - 1, (n,), generator=gen, dtype=torch.int16)
        values = bits.view(dtype).to(torch.float32)
    normal = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen)
                                                           .float())
    values = torch.where(torch.arange(n) % 2 == 0, values, normal)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40,
                             70000.0, -70000.0, 65504.0, 65520.0, 6e-8, 1e-45, 3.0e38, 1.0, -1.0])
    values[: len(specials)] = specials
    out = values.to(dtype)
    if dtype != torch.float32:
        # Random distinct bit patterns (4304 of the 65536) for the 2-byte formats.
        patterns = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        k = min(n - 32, patterns.numel())
        perm = torch.randperm(patterns.numel(), generator=gen)[:k]
        out[32:32 + k] = patterns[perm]
    return out.reshape(rows, cols)


def write_family(directory: Path, dtype: torch.dtype, scale: float | None,
                 rows=ROWS) -> torch.Tensor:
    """A shard family ``emb.shard_{i}.weight``, each shard in its own file, and
    ``emb.weight_scale`` when ``scale`` is given; returns the full table."""
    full = table_values(dtype, sum(rows))
    start = 0
    for i, r in enumerate(rows):
        tensors = {f"emb.shard_{i}.weight": full[start:start + r].contiguous()}
        if i == 0 and scale is not None:
            tensors["emb.weight_scale"] = torch.tensor(scale, dtype=torch.float32)
        save_file(tensors, str(directory / f"shard{i}.safetensors"))
        start += r
    return full


def reference(rows: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """torch's own conversion of ``rows``, as the README describes it."""
    if rows.dtype in SCALED:
        return (rows.to(torch.float32) * scale).to(dtype)
    return rows.to(dtype)


def assert_same(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
    # Signs of zeros too.
    assert torch.equal(torch.signbit(out) & (out == 0), torch.signbit(ref) & (ref == 0))


def all_ids(num_rows: int, seed: int = 1) -> torch.Tensor:
    """Every row once, shuffled, then some repeats."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_rows, generator=gen)
    return torch.cat([perm, perm[:37], torch.tensor([0, num_rows - 1, 0])])


# --------------------------------------------------------------------------- values


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """Opened tables by (dtype, scale kind), with their values and the scale they use."""
    opened = {}

    def get(dtype, scale_kind):
        key = (dtype, scale_kind)
        if key not in opened:
            d = tmp_path_factory.mktemp(f"{FORMATS[dtype]}_{scale_kind}")
            file_scale = 0.37 if scale_kind == "file" else None
            full = write_family(d, dtype, file_scale)
            kwarg = 0.37 if scale_kind == "kwarg" else None
            table = ple.Table.from_safetensors(d, "emb", scale=kwarg)
            expected_scale = {"file": torch.tensor(0.37).item(), "kwarg": 0.37, "none": 1.0}
            opened[key] = (table, full, expected_scale[scale_kind])
        return opened[key]

    yield get
    for table, _, _ in opened.values():
        table.close()


CASES = ([(d, "none") for d in FORMATS]
         + [(d, k) for d in SCALED for k in ("file", "kwarg")])


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype,scale_kind", CASES,
                         ids=[f"{FORMATS[d]}-scale_{k}" for d, k in CASES])
def test_values_equal_torch_conversion(tables, dtype, scale_kind, out_dtype):
    table, full, scale = tables(dtype, scale_kind)
    assert table.format == FORMATS[dtype]
    assert table.scale == scale
    want_dtype = table.dtype if out_dtype is None else out_dtype
    if out_dtype is None:
        assert want_dtype == (dtype if dtype not in SCALED else torch.float32)
    ids = all_ids(table.num_rows)
    out = torch.ops.ple.disk_gather(ids, table.handle, out_dtype)
    assert_same(out, reference(take_rows(full, ids), want_dtype, scale))


@pytest.mark.parametrize("dtype", list(FORMATS), ids=list(FORMATS.values()))
def test_default_dtype_same_as_omitted(tables, dtype):
    table, full, scale = tables(dtype, "none")
    ids = all_ids(table.num_rows, seed=5)
    a = torch.ops.ple.disk_gather(ids, table.handle)
    b = torch.ops.ple.disk_gather(ids, table.handle, None)
    c = torch.ops.ple.disk_gather(ids, table.handle, dtype=table.dtype)
    for x in (a, b, c):
        assert_same(x, reference(take_rows(full, ids), table.dtype, scale))


def test_fp8_has_every_pattern_and_nans(tables):
    table, full, _ = tables(torch.float8_e4m3fn, "file")
    assert set(full.view(torch.uint8).flatten().tolist()) == set(range(256))
    ids = torch.arange(table.num_rows)
    out = torch.ops.ple.disk_gather(ids, table.handle)
    nan_bits = (full.view(torch.uint8) & 0x7F) == 0x7F
    assert torch.equal(torch.isnan(out), nan_bits)
    assert int(nan_bits.sum()) >= 2


@pytest.mark.parametrize("dtype", list(FORMATS), ids=list(FORMATS.values()))
def test_bytes_are_the_stored_bytes(tables, dtype):
    table, full, _ = tables(dtype, "none")
    ids = all_ids(table.num_rows, seed=3)
    out = torch.ops.ple.disk_gather_bytes(ids, table.handle)
    assert out.dtype == torch.uint8
    assert torch.equal(out, take_rows(full, ids).view(torch.uint8))


def test_single_tensor_with_scale(tmp_path):
    for dtype in SCALED:
        t = table_values(dtype, 40)
        f = tmp_path / f"{FORMATS[dtype]}.safetensors"
        save_file({"tab": t, "tab_scale": torch.tensor(-2.5)}, str(f))
        with ple.Table.from_safetensors(f) as table:
            assert table.scale == -2.5
            ids = torch.arange(40)
            for out_dtype in OUT_DTYPES[:3]:
                assert_same(torch.ops.ple.disk_gather(ids, table.handle, out_dtype),
                            reference(t, out_dtype, -2.5))


# --------------------------------------------------------------------------- ids


@pytest.fixture(scope="module")
def f32_table(tables):
    return tables(torch.float32, "none")[:2]


@pytest.fixture(scope="module")
def i8_table(tables):
    return tables(torch.int8, "file")[:2]


def test_ids_2d_shape(i8_table):
    table, full = i8_table
    ids = torch.randint(0, table.num_rows, (3, 5))
    out = torch.ops.ple.disk_gather(ids, table.handle, torch.bfloat16)
    assert out.shape == (3, 5, COLS)
    assert_same(out, reference(take_rows(full, ids), torch.bfloat16, table.scale))
    assert torch.ops.ple.disk_gather_bytes(ids, table.handle).shape == (3, 5, table.row_bytes)


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)])
def test_ids_empty(i8_table, shape):
    table, _ = i8_table
    ids = torch.empty(shape, dtype=torch.int64)
    for dtype, want in ((None, torch.float32), (torch.float16, torch.float16)):
        out = torch.ops.ple.disk_gather(ids, table.handle, dtype)
        assert out.shape == (*shape, COLS)
        assert out.dtype == want
    assert torch.ops.ple.disk_gather_bytes(ids, table.handle).shape == (*shape, table.row_bytes)


def test_ids_scalar(f32_table):
    table, full = f32_table
    out = torch.ops.ple.disk_gather(torch.tensor(98), table.handle)
    assert out.shape == (COLS,)
    assert_same(out, full[98])


def test_ids_non_contiguous(f32_table, i8_table):
    for table, full in (f32_table, i8_table):
        ids2d = torch.randint(0, table.num_rows, (4, 7))
        for ids in (ids2d.t(), ids2d[:, ::2], all_ids(table.num_rows)[::3],
                    torch.stack([torch.arange(table.num_rows).flip(0),
                                 torch.zeros(table.num_rows, dtype=torch.int64)], 1)[:, 0],
                    ids2d.expand(2, 4, 7)):
            assert not ids.is_contiguous()
            for dtype in (None, torch.float16):
                out = torch.ops.ple.disk_gather(ids, table.handle, dtype)
                want = reference(take_rows(full, ids), table.dtype if dtype is None else dtype,
                                 table.scale)
                assert_same(out, want)


def test_ids_int32(f32_table, i8_table):
    for table, full in (f32_table, i8_table):
        ids = all_ids(table.num_rows).to(torch.int32)
        out = torch.ops.ple.disk_gather(ids, table.handle, torch.float32)
        assert_same(out, reference(full[ids.long()], torch.float32, table.scale))
        ids2d = ids[:30].reshape(5, 6).t()
        out = torch.ops.ple.disk_gather(ids2d, table.handle)
        assert_same(out, reference(full[ids2d.long()], table.dtype, table.scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int16, torch.uint8,
                                   torch.bool])
def test_ids_bad_dtype(f32_table, dtype):
    table, _ = f32_table
    ids = torch.tensor([0, 1]).to(dtype)
    with pytest.raises(TypeError, match="ids"):
        torch.ops.ple.disk_gather(ids, table.handle)
    with pytest.raises(TypeError, match="ids"):
        torch.ops.ple.disk_gather_bytes(ids, table.handle)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.float64,
                                   torch.float8_e4m3fn, torch.complex64])
def test_bad_output_dtype(f32_table, i8_table, dtype):
    for table, _ in (f32_table, i8_table):
        with pytest.raises(TypeError, match="dtype"):
            torch.ops.ple.disk_gather(torch.tensor([0]), table.handle, dtype)


def test_unknown_handle():
    handle = "emb@0123456789abcdef"
    with pytest.raises(ValueError, match=rf"\(handle {handle}\) is not open in this process"):
        torch.ops.ple.disk_gather(torch.tensor([0]), handle)
    with pytest.raises(ValueError, match=rf"\(handle {handle}\) is not open in this process"):
        torch.ops.ple.disk_gather(torch.tensor([0]), handle, torch.float16)
    with pytest.raises(ValueError, match=rf"\(handle {handle}\) is not open in this process"):
        torch.ops.ple.disk_gather_bytes(torch.tensor([0]), handle)


@pytest.mark.parametrize("name", ["no_table_has_this_name", ""])
def test_a_name_that_is_no_handle(name):
    expected = (f"ple: '{name}' is not a table handle (\"<name>@<digest>\"): pass an open "
                "table's table.handle, or call ple.gather(table, ids)")
    for call in (torch.ops.ple.disk_gather, torch.ops.ple.disk_gather_bytes):
        with pytest.raises(ValueError) as raised:
            call(torch.tensor([0]), name)
        assert str(raised.value) == expected


def test_output_is_new_and_writable(f32_table):
    table, full = f32_table
    ids = torch.tensor([5, 5])
    a = torch.ops.ple.disk_gather(ids, table.handle)
    a[0].fill_(123.0)
    assert torch.equal(a[1], full[5])
    b = torch.ops.ple.disk_gather(ids, table.handle)
    assert torch.equal(b[0], full[5])
    assert b.is_contiguous()
