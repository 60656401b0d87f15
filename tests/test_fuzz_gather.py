"""Property tests (hypothesis) of the gather against NumPy and torch references.

Random table geometry (1-4 shards of 1-300 rows, the last possibly shorter, or
one 2-D tensor; rows of 1-9000 bytes; shards spread over one or two files
behind padding tensors that shift them off page alignment), random ids with
duplicates and the boundary rows, int32 and int64 ids, every policy with a
random window and 1-3 threads: ``table.gather_bytes`` must equal the array
that was written, byte for byte, and the counters must agree with the request.
Then the values of ``torch.ops.ple.disk_gather`` for every row format, from
random bit patterns and scales, must equal torch's own conversion.

Each example writes its own files, so the example counts are kept small;
tables are U8 tensors of width ``row_bytes`` so that the reference of the
byte gather is the written array itself.  ``PLE_FUZZ_EXAMPLES=1000 pytest
tests/test_fuzz_gather.py`` searches longer.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import ple
from helpers import PAGE, ByteTable, take_rows, write_byte_table
from ple import GatherConfig
from ple.config import POLICIES

WINDOWS_KIB = (0, 4, 64, 4096, 1 << 40)  # 1 << 40 KiB: larger than any request

# database=None: no .hypothesis directory in the repository.  The same
# examples every run (derandomize) unless PLE_FUZZ_EXAMPLES asks for a
# longer, random search.
FUZZ = settings(max_examples=int(os.environ.get("PLE_FUZZ_EXAMPLES", 40)), deadline=None,
                database=None, derandomize="PLE_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------- the byte gather


@dataclass
class Geometry:
    family: bool  # a shard family t.shard_{i}.weight, else one tensor "t"
    shard_rows: list[int]
    row_bytes: int
    shard_file: list[int]  # 0 or 1: which file holds each shard
    pads: tuple[int, int]  # bytes of the 1-D "pad{f}" tensor in file f (0: none)
    seed: int
    name_tensor: bool  # pass tensor="t" or leave it out


@st.composite
def geometries(draw) -> Geometry:
    row_bytes = draw(st.one_of(st.integers(1, 64), st.integers(1, 9000),
                               st.sampled_from([PAGE - 1, PAGE, PAGE + 1, 2 * PAGE + 1])))
    family = draw(st.booleans())
    if family:
        shards = draw(st.integers(1, 4))
        rows = draw(st.integers(1, 300))
        last = draw(st.integers(1, rows))
        shard_rows = [rows] * (shards - 1) + [last]
        shard_file = draw(st.lists(st.integers(0, 1), min_size=shards, max_size=shards))
    else:
        shard_rows = [draw(st.integers(1, 300))]
        shard_file = [draw(st.integers(0, 1))]
    pads = (draw(st.sampled_from([0, 1, 13, 1001, PAGE - 3])),
            draw(st.sampled_from([0, 7, 4099])))
    return Geometry(family, shard_rows, row_bytes, shard_file, pads,
                    draw(st.integers(0, 2**32 - 1)), draw(st.booleans()))


def _write(g: Geometry, directory: Path) -> ByteTable:
    return write_byte_table([directory / "part0.safetensors", directory / "part1.safetensors"],
                            g.shard_rows, g.row_bytes, seed=g.seed, shard_file=g.shard_file,
                            pads=g.pads, family=g.family, tensor="t" if g.name_tensor else None)


@st.composite
def requests(draw) -> tuple[int, int, list[int], bool]:
    """(size, seed, boundary picks, int32): the ids are drawn from the seed
    once the table's size is known; boundary picks index its boundary rows."""
    size = draw(st.one_of(st.integers(0, 16), st.integers(0, 3000)))
    picks = draw(st.lists(st.integers(0, 1000), max_size=12))
    return size, draw(st.integers(0, 2**32 - 1)), picks, draw(st.booleans())


def _ids(num_rows: int, shard_rows: list[int], request) -> np.ndarray:
    size, seed, picks, _ = request
    rng = np.random.default_rng(seed)
    boundaries = {0, num_rows - 1}
    start = 0
    for n in shard_rows[:-1]:
        start += n
        boundaries.update((start - 1, start))
    boundaries = sorted(boundaries)
    ids = rng.integers(0, num_rows, size, dtype=np.int64)
    if size:  # duplicates on purpose: repeat a random slice
        ids = np.concatenate([ids, rng.choice(ids, min(size, 50))])
    ids = np.concatenate([ids, [boundaries[p % len(boundaries)] for p in picks]]).astype(np.int64)
    return rng.permutation(ids)


@FUZZ
@given(geometry=geometries(), request=requests(),
       configs=st.tuples(*[st.tuples(st.sampled_from(WINDOWS_KIB), st.integers(1, 3),
                                     st.booleans()) for _ in POLICIES]))
def test_gather_bytes_equals_numpy_reference(geometry, request, configs):
    with tempfile.TemporaryDirectory() as tmp:
        w = _write(geometry, Path(tmp))
        table = w.table
        try:
            num_rows = sum(geometry.shard_rows)
            assert table.num_rows == num_rows and table.row_bytes == geometry.row_bytes
            assert table.shard_rows == geometry.shard_rows
            ids = _ids(num_rows, geometry.shard_rows, request)
            ids_t = torch.from_numpy(ids).to(torch.int32 if request[3] else torch.int64)
            expected = w.reference[ids]
            expected_pages = w.expected_pages(ids)
            for policy, (window, threads, cold) in zip(POLICIES, configs):
                table.config = GatherConfig(policy, window, threads)
                if cold:
                    table.drop_page_cache()
                table.reset_stats()
                got = table.gather_bytes(ids_t)
                assert got.dtype == torch.uint8
                assert tuple(got.shape) == (len(ids), geometry.row_bytes)
                assert np.array_equal(got.numpy(), expected), (policy, window, threads)

                s = table.stats()
                assert s["calls"] == 1
                assert s["rows"] == len(ids)
                assert s["bytes_copied"] == len(ids) * geometry.row_bytes
                assert s["unique_pages"] == expected_pages
                assert s["advised_pages"] <= s["unique_pages"]
                assert s["advised_pages"] + s["resident_pages"] <= s["unique_pages"]
                if policy == "none" or window == 0:
                    assert s["advised_pages"] == 0 and s["max_advised_ahead_bytes"] == 0
                if policy == "window":
                    assert s["max_advised_ahead_bytes"] <= window * 1024
                if policy == "all" and window > 0:
                    assert s["advised_pages"] == s["unique_pages"] - s["resident_pages"]
        finally:
            table.close()


# ---------------------------------------------------------------- decoded values


STORAGE = {
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "fp8_e4m3fn": torch.float8_e4m3fn, "u8": torch.uint8, "i8": torch.int8,
}
SCALED = {"fp8_e4m3fn", "u8", "i8"}
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@st.composite
def scales(draw, fmt: str):
    """(where the scale comes from, its value, the scale tensor's dtype)."""
    if fmt not in SCALED:
        return "none", 1.0, None
    source = draw(st.sampled_from(["none", "arg", "file"]))
    value = draw(st.one_of(st.floats(width=32),
                           st.sampled_from([1.0, -1.0, 0.0, -0.0, 2.0**-20, 448.0, 1 / 3])))
    return source, value, draw(st.sampled_from(SCALE_DTYPES))


@st.composite
def decode_cases(draw):
    fmt = draw(st.sampled_from(sorted(STORAGE)))
    return (fmt, draw(st.integers(1, 40)), draw(st.integers(1, 64)), draw(st.integers(0, 2**32 - 1)),
            draw(scales(fmt)), draw(st.sampled_from([None, torch.float32, torch.float16,
                                                     torch.bfloat16])),
            draw(st.booleans()))


@FUZZ
@given(case=decode_cases())
def test_disk_gather_values_equal_torch_conversion(case):
    fmt, rows, cols, seed, (source, scale, scale_dtype), out_dtype, int32 = case
    storage = STORAGE[fmt]
    rng = np.random.default_rng(seed)
    # Random bit patterns: NaNs (with payloads), infinities, subnormals, -0.
    bits = rng.integers(0, 256, rows * cols * storage.itemsize, dtype=np.uint8)
    values = torch.from_numpy(bits).view(storage).reshape(rows, cols).clone()
    tensors = {"t": values}
    kwargs = {}
    if source == "file":
        tensors["t_scale"] = torch.tensor(scale, dtype=scale_dtype)
        scale = torch.tensor(scale, dtype=scale_dtype).item()  # what the file holds
    elif source == "arg":
        kwargs["scale"] = scale
    else:
        scale = 1.0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        save_file(tensors, str(path))
        with ple.Table.from_safetensors(path, "t", **kwargs) as table:
            assert table.format == fmt
            ids = torch.from_numpy(np.concatenate([rng.integers(0, rows, 3 * rows), [0, rows - 1]]))
            ids = ids.to(torch.int32 if int32 else torch.int64)
            got = torch.ops.ple.disk_gather(ids, table.handle, out_dtype)

    dtype = out_dtype or (torch.float32 if fmt in SCALED else storage)
    picked = take_rows(values, ids.long())
    expected = ((picked.to(torch.float32) * scale).to(dtype) if fmt in SCALED
                else picked.to(dtype))
    assert got.dtype == dtype and got.shape == (len(ids), cols)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
