"""torch.ops.ple.disk_gather / disk_gather_bytes: opcheck, torch.compile
with fullgraph=True, and the operators' input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo
from safetensors.torch import save_file

import ple
from ple import GatherConfig

SHARD_ROWS = (97, 97, 77)
NUM_ROWS = sum(SHARD_ROWS)
COLS = 12


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """An F32 shard family over two files; reference = the values written."""
    directory = tmp_path_factory.mktemp("ops")
    rng = np.random.default_rng(0)
    shards = [rng.standard_normal((n, COLS)).astype(np.float32) for n in SHARD_ROWS]
    save_file({"e.shard_0.weight": torch.from_numpy(shards[0]),
               "e.shard_2.weight": torch.from_numpy(shards[2])}, str(directory / "a.safetensors"))
    save_file({"e.shard_1.weight": torch.from_numpy(shards[1])}, str(directory / "b.safetensors"))
    t = ple.Table.from_safetensors(directory, config=GatherConfig("window", 64, 2))
    t.reference = torch.from_numpy(np.concatenate(shards))
    yield t
    t.close()


def _ids(seed: int, shape, dtype=torch.int64) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, NUM_ROWS, shape)).to(dtype)


def _ref_bytes(table, ids: torch.Tensor) -> torch.Tensor:
    return table.reference[ids.long()].contiguous().view(torch.uint8)


# ---------------------------------------------------------------- eager


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_eager_results(table, dtype):
    ids = _ids(1, (600,), dtype)
    ids[:4] = torch.tensor([0, NUM_ROWS - 1, 96, 97], dtype=dtype)
    raw = torch.ops.ple.disk_gather_bytes(ids, table.handle)
    assert raw.dtype == torch.uint8 and raw.shape == (600, COLS * 4)
    assert torch.equal(raw, _ref_bytes(table, ids))
    values = torch.ops.ple.disk_gather(ids, table.handle)
    assert values.dtype == torch.float32
    assert torch.equal(values, table.reference[ids.long()])
    halves = torch.ops.ple.disk_gather(ids, table.handle, torch.bfloat16)
    assert halves.dtype == torch.bfloat16
    assert torch.equal(halves, table.reference[ids.long()].to(torch.bfloat16))


def test_non_contiguous_ids(table):
    base = _ids(2, (30, 20))
    for ids in (base.t(), base[:, ::3], base.reshape(-1)[::7]):
        assert not ids.is_contiguous()
        assert torch.equal(torch.ops.ple.disk_gather(ids, table.handle), table.reference[ids])
        assert torch.equal(torch.ops.ple.disk_gather_bytes(ids, table.handle),
                           _ref_bytes(table, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_float_ids_raise_type_error(table, dtype):
    ids = torch.zeros(3, dtype=dtype)
    with pytest.raises(TypeError):
        torch.ops.ple.disk_gather(ids, table.handle)
    with pytest.raises(TypeError):
        torch.ops.ple.disk_gather_bytes(ids, table.handle)


def test_unknown_handle_raises_value_error(table):
    bad = "e@0123456789abcdef"  # the name of an open table, other files
    ids = torch.zeros(3, dtype=torch.int64)
    expected = (rf"ple table 'e' \(handle {bad}\) is not open in this process; the table of that "
                rf"name open here, {table.handle}, is another one")
    with pytest.raises(ValueError, match=expected):
        torch.ops.ple.disk_gather(ids, bad)
    with pytest.raises(ValueError, match=expected):
        torch.ops.ple.disk_gather_bytes(ids, bad)


def test_closed_table_handle_raises_value_error(tmp_path):
    save_file({"w": torch.zeros(4, 3)}, str(tmp_path / "w.safetensors"))
    t = ple.Table.from_safetensors(tmp_path / "w.safetensors")
    handle = t.handle
    t.close()
    with pytest.raises(ValueError):
        torch.ops.ple.disk_gather(torch.zeros(1, dtype=torch.int64), handle)


def test_bad_output_dtype_raises_type_error(table):
    with pytest.raises(TypeError):
        torch.ops.ple.disk_gather(torch.zeros(2, dtype=torch.int64), table.handle, torch.int32)


def test_out_of_range_id_raises_index_error(table):
    ids = torch.tensor([0, NUM_ROWS], dtype=torch.int64)
    with pytest.raises(IndexError, match=rf"{NUM_ROWS}.*\[0, {NUM_ROWS}\)"):
        torch.ops.ple.disk_gather(ids, table.handle)


# ---------------------------------------------------------------- opcheck


@pytest.mark.parametrize("ids_shape,ids_dtype", [
    ((50,), torch.int64), ((50,), torch.int32), ((6, 7), torch.int64)], ids=str)
def test_opcheck_disk_gather_bytes(table, ids_shape, ids_dtype):
    ids = _ids(3, ids_shape, ids_dtype)
    torch.library.opcheck(torch.ops.ple.disk_gather_bytes.default, (ids, table.handle))


@pytest.mark.parametrize("ids_shape,ids_dtype,dtype", [
    ((50,), torch.int64, None), ((50,), torch.int32, torch.bfloat16),
    ((6, 7), torch.int64, torch.bfloat16), ((6, 7), torch.int32, None)], ids=str)
def test_opcheck_disk_gather(table, ids_shape, ids_dtype, dtype):
    ids = _ids(4, ids_shape, ids_dtype)
    torch.library.opcheck(torch.ops.ple.disk_gather.default, (ids, table.handle, dtype))


# ---------------------------------------------------------------- compile


def _compile_and_compare(fn, eager, id_sets):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, fullgraph=True)
    for ids in id_sets:
        got = compiled(ids)
        want = eager(ids)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    assert not torch._dynamo.utils.counters["graph_break"], \
        dict(torch._dynamo.utils.counters["graph_break"])


ID_SETS = [
    lambda: _ids(10, (64,)),
    lambda: _ids(11, (64,)),  # same shape, different ids
    lambda: _ids(12, (5, 9)),  # different rank
    lambda: _ids(13, (300,)),  # different length
]


@pytest.mark.slow
def test_compile_disk_gather_fullgraph(table):
    handle = table.handle  # a Python int constant in the graph

    def f(ids):
        return torch.ops.ple.disk_gather(ids, handle, torch.float32) * 2 + 1

    def eager(ids):
        want = torch.ops.ple.disk_gather(ids, handle, torch.float32) * 2 + 1
        assert torch.equal(want, table.reference[ids] * 2 + 1)
        return want

    _compile_and_compare(f, eager, [make() for make in ID_SETS])
    torch._dynamo.reset()


def test_compile_disk_gather_bytes_fullgraph(table):
    handle = table.handle

    def f(ids):
        return torch.ops.ple.disk_gather_bytes(ids, handle)

    def eager(ids):
        want = torch.ops.ple.disk_gather_bytes(ids, handle)
        assert torch.equal(want, _ref_bytes(table, ids))
        return want

    _compile_and_compare(f, eager, [make() for make in ID_SETS])
    torch._dynamo.reset()
