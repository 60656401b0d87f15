"""Opening tables with ple.Table.from_safetensors, and every error at open.

Tables are written with the ``safetensors`` package (an independent writer);
corrupt files are written byte by byte.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ple
from ple import GatherConfig

SHARD_ROWS = (97, 97, 77)
COLS = 6


# --------------------------------------------------------------------------- helpers


def write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Writes ``tensors`` with the safetensors package; returns ``path``."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def write_raw(path: Path, header, data: bytes = b"", length: int | None = None) -> Path:
    """Writes a safetensors file by hand: 8 bytes of length, header, data.
    ``header`` is an object (dumped as JSON) or raw bytes; ``length`` overrides
    the header length field."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def shards(rows=SHARD_ROWS, cols=COLS, dtype=torch.float32, prefix="emb", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {f"{prefix}.shard_{i}.weight": torch.randn(r, cols, generator=gen).to(dtype)
            for i, r in enumerate(rows)}


def raises_naming(exc, *names):
    """pytest.raises(exc) whose message must contain every one of ``names``."""
    pattern = "".join(f"(?=.*{re.escape(str(n))})" for n in names)
    return pytest.raises(exc, match=re.compile(pattern, re.DOTALL))


def gather(table, ids):
    return torch.ops.ple.disk_gather(torch.as_tensor(ids, dtype=torch.int64), table.handle)


# --------------------------------------------------------------------------- paths


def test_one_file_as_str_and_path(tmp_path):
    t = torch.randn(40, COLS)
    f = write(tmp_path / "one.safetensors", {"table": t})
    for p in (f, str(f)):
        with ple.Table.from_safetensors(p) as table:
            assert table.num_rows == 40
            assert table.name == "table"
            assert torch.equal(gather(table, range(40)), t)


def test_list_of_files_with_shards_spread(tmp_path):
    s = shards()
    names = list(s)
    files = [write(tmp_path / f"part{i}.safetensors", {n: s[n]}) for i, n in enumerate(names)]
    full = torch.cat(list(s.values()))
    with ple.Table.from_safetensors(files, "emb") as table:
        assert table.num_rows == sum(SHARD_ROWS) == 271
        assert table.shard_rows == list(SHARD_ROWS)
        assert torch.equal(gather(table, range(271)), full)
    # A list of str, in another order: shard indices decide the row order.
    with ple.Table.from_safetensors([str(f) for f in reversed(files)], "emb") as table:
        assert torch.equal(gather(table, range(271)), full)


def test_directory_of_shards(tmp_path):
    s = shards()
    names = list(s)
    # File names sort in another order than the shard indices.
    write(tmp_path / "z.safetensors", {names[0]: s[names[0]]})
    write(tmp_path / "a.safetensors", {names[1]: s[names[1]]})
    write(tmp_path / "m.safetensors", {names[2]: s[names[2]], "emb.bias": torch.randn(COLS)})
    (tmp_path / "README.txt").write_text("not a table")
    with ple.Table.from_safetensors(tmp_path) as table:  # one candidate: the family
        assert table.name == "emb"
        assert table.num_rows == 271
        assert torch.equal(gather(table, range(271)), torch.cat(list(s.values())))
    with ple.Table.from_safetensors(str(tmp_path), tensor="emb") as table:
        assert table.num_rows == 271


def test_list_mixing_directory_and_file(tmp_path):
    s = shards()
    names = list(s)
    d = tmp_path / "dir"
    d.mkdir()
    write(d / "a.safetensors", {names[0]: s[names[0]], names[1]: s[names[1]]})
    other = write(tmp_path / "b.safetensors", {names[2]: s[names[2]]})
    with ple.Table.from_safetensors([d, other]) as table:
        assert table.num_rows == 271
        assert torch.equal(gather(table, [0, 96, 97, 194, 270]),
                           torch.cat(list(s.values()))[[0, 96, 97, 194, 270]])


def test_tensor_names_single_tensor_among_others(tmp_path):
    a, b = torch.randn(10, 3), torch.randn(20, 5)
    f = write(tmp_path / "t.safetensors", {"a": a, "b": b, **shards(rows=(4, 4))})
    with ple.Table.from_safetensors(f, tensor="b") as table:
        assert (table.name, table.num_rows, table.cols) == ("b", 20, 5)
        assert torch.equal(gather(table, range(20)), b)
    with ple.Table.from_safetensors(f, tensor="emb") as table:
        assert (table.num_rows, table.cols) == (8, COLS)


def test_tensor_omitted_one_candidate(tmp_path):
    t = torch.randn(12, 4)
    f = write(tmp_path / "t.safetensors", {"only": t, "bias": torch.randn(4),
                                           "cube": torch.randn(2, 2, 2)})
    with ple.Table.from_safetensors(f) as table:
        assert table.name == "only"
        assert torch.equal(gather(table, range(12)), t)


def test_tensor_omitted_several_candidates(tmp_path):
    f = write(tmp_path / "t.safetensors", {"other": torch.randn(3, 4), "zz_vec": torch.randn(4),
                                           **shards(rows=(5, 5))})
    with raises_naming(ValueError, f, "'emb.shard_*'", "'other'", "tensor=") as info:
        ple.Table.from_safetensors(f)
    msg = str(info.value)
    assert "zz_vec" not in msg  # 1-D: not a candidate
    assert "shard_0" not in msg  # a family is one candidate, by its prefix


def test_name_of_both_a_tensor_and_a_shard_family(tmp_path):
    f = write(tmp_path / "t.safetensors", {"emb": torch.randn(3, COLS), **shards(rows=(5, 5))})
    with raises_naming(ValueError, f, "'emb'", "both a tensor and a shard family"):
        ple.Table.from_safetensors(f, "emb")


def test_tensor_omitted_no_candidate(tmp_path):
    f = write(tmp_path / "t.safetensors", {"vec": torch.randn(4)})
    with raises_naming(ValueError, f, "0 candidate"):
        ple.Table.from_safetensors(f)


def test_metadata_is_ignored(tmp_path):
    t = torch.randn(5, 4)
    path = tmp_path / "t.safetensors"
    save_file({"t": t}, str(path), metadata={"format": "pt"})
    with ple.Table.from_safetensors(path) as table:
        assert table.name == "t"
        assert torch.equal(gather(table, range(5)), t)


# --------------------------------------------------------------------------- attributes

DTYPES = [
    # torch dtype, format, itemsize, default output dtype
    (torch.float32, "f32", 4, torch.float32),
    (torch.float16, "f16", 2, torch.float16),
    (torch.bfloat16, "bf16", 2, torch.bfloat16),
    (torch.float8_e4m3fn, "fp8_e4m3fn", 1, torch.float32),
    (torch.uint8, "u8", 1, torch.float32),
    (torch.int8, "i8", 1, torch.float32),
]


def make_values(dtype, shape):
    if dtype in (torch.uint8, torch.int8):
        return torch.randint(0, 256, shape, dtype=torch.uint8).view(dtype)
    return torch.randn(shape).to(dtype)


@pytest.mark.parametrize("dtype,fmt,itemsize,default", DTYPES, ids=[d[1] for d in DTYPES])
def test_attributes(tmp_path, dtype, fmt, itemsize, default):
    cols = 7
    s = {f"emb.shard_{i}.weight": make_values(dtype, (r, cols)) for i, r in enumerate(SHARD_ROWS)}
    f = write(tmp_path / "t.safetensors", s)
    with ple.Table.from_safetensors(f) as table:
        assert table.num_rows == 271
        assert table.cols == cols
        assert table.row_bytes == cols * itemsize
        assert table.format == fmt
        assert table.dtype == default
        assert table.scale == 1.0
        assert re.fullmatch(r"emb@[0-9a-f]{16}", table.handle)
        r = repr(table)
        assert "'emb'" in r and "271" in r and fmt in r and f"handle={table.handle!r}" in r
    assert "closed" in repr(table)


def test_handles_are_distinct(tmp_path):
    f = write(tmp_path / "t.safetensors", {"t": torch.randn(3, 4)})
    with ple.Table.from_safetensors(f) as a, ple.Table.from_safetensors(f) as b:
        assert a.handle != b.handle


# --------------------------------------------------------------------------- scale

F32_037 = torch.tensor(0.37, dtype=torch.float32).item()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8, torch.int8])
def test_family_scale_read(tmp_path, dtype):
    s = {k: make_values(dtype, v.shape) for k, v in shards().items()}
    f = write(tmp_path / "t.safetensors", {**s, "emb.weight_scale": torch.tensor(0.37)})
    with ple.Table.from_safetensors(f) as table:
        assert table.name == "emb"  # the scale is not a candidate table
        assert table.scale == F32_037


def test_family_scale_in_another_file(tmp_path):
    s = {k: make_values(torch.int8, v.shape) for k, v in shards().items()}
    write(tmp_path / "a.safetensors", s)
    write(tmp_path / "b.safetensors", {"emb.weight_scale": torch.tensor(0.25)})
    with ple.Table.from_safetensors(tmp_path) as table:
        assert table.scale == 0.25


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_single_tensor_scale_read(tmp_path, scale_dtype):
    t = make_values(torch.uint8, (10, 4))
    value = torch.tensor(0.37, dtype=scale_dtype)
    f = write(tmp_path / "t.safetensors", {"tab": t, "tab_scale": value})
    with ple.Table.from_safetensors(f, "tab") as table:
        assert table.scale == value.item()
    # A shape-[1] scale holds one value too.
    f2 = write(tmp_path / "t2.safetensors", {"tab": t, "tab_scale": value.reshape(1)})
    with ple.Table.from_safetensors(f2, "tab") as table:
        assert table.scale == value.item()


def test_scale_argument_used_when_file_has_none(tmp_path):
    f = write(tmp_path / "t.safetensors", {"tab": make_values(torch.int8, (10, 4))})
    with ple.Table.from_safetensors(f, scale=0.37) as table:
        assert table.scale == 0.37
    with ple.Table.from_safetensors(f, scale=2) as table:
        assert table.scale == 2.0 and isinstance(table.scale, float)


def test_scale_default_is_one(tmp_path):
    f = write(tmp_path / "t.safetensors", {"tab": make_values(torch.float8_e4m3fn, (10, 4))})
    with ple.Table.from_safetensors(f) as table:
        assert table.scale == 1.0


def test_scale_argument_equal_to_file_is_fine(tmp_path):
    f = write(tmp_path / "t.safetensors", {"tab": make_values(torch.int8, (10, 4)),
                                           "tab_scale": torch.tensor(0.5)})
    with ple.Table.from_safetensors(f, scale=0.5) as table:
        assert table.scale == 0.5


def test_scale_conflict(tmp_path):
    f = write(tmp_path / "t.safetensors", {"tab": make_values(torch.int8, (10, 4)),
                                           "tab_scale": torch.tensor(0.5)})
    with raises_naming(ValueError, f, "tab_scale", "0.5", "scale=0.25"):
        ple.Table.from_safetensors(f, scale=0.25)


def test_scale_given_agrees_once_rounded_to_the_file_dtype(tmp_path):
    f = write(tmp_path / "t.safetensors", {"tab": make_values(torch.int8, (10, 4)),
                                           "tab_scale": torch.tensor(0.37)})
    with ple.Table.from_safetensors(f, scale=0.37) as table:
        assert table.scale == torch.tensor(0.37).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scale_on_unscaled_format(tmp_path, dtype):
    f = write(tmp_path / "t.safetensors", {"tab": torch.randn(10, 4).to(dtype)})
    with raises_naming(ValueError, f, "'tab'", "not scaled"):
        ple.Table.from_safetensors(f, scale=0.5)
    g = write(tmp_path / "g.safetensors", {"tab": torch.randn(10, 4).to(dtype),
                                           "tab_scale": torch.tensor(0.5)})
    with raises_naming(ValueError, g, "'tab'", "not scaled"):
        ple.Table.from_safetensors(g)


@pytest.mark.parametrize("bad", [torch.tensor([0.5, 0.25]), torch.tensor(2, dtype=torch.int32),
                                 torch.tensor(0.5, dtype=torch.float64)], ids=["two", "i32", "f64"])
def test_bad_scale_tensor(tmp_path, bad):
    f = write(tmp_path / "t.safetensors", {"tab": make_values(torch.int8, (10, 4)),
                                           "tab_scale": bad})
    with raises_naming(ValueError, f, "'tab_scale'"):
        ple.Table.from_safetensors(f, "tab")


# --------------------------------------------------------------------------- errors: files


def test_missing_file(tmp_path):
    p = tmp_path / "nope.safetensors"
    with raises_naming(FileNotFoundError, p):
        ple.Table.from_safetensors(p)
    ok = write(tmp_path / "ok.safetensors", {"t": torch.randn(3, 4)})
    with raises_naming(FileNotFoundError, p) as info:
        ple.Table.from_safetensors([ok, p])
    assert info.value.filename == str(p)


def test_directory_without_safetensors(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "x.bin").write_bytes(b"12345678")
    with raises_naming(FileNotFoundError, d):
        ple.Table.from_safetensors(d)


def test_empty_list_of_paths():
    with pytest.raises(ValueError):
        ple.Table.from_safetensors([])


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file(tmp_path):
    f = write(tmp_path / "t.safetensors", {"t": torch.randn(3, 4)})
    f.chmod(0)
    try:
        with raises_naming(PermissionError, f):
            ple.Table.from_safetensors(f)
    finally:
        f.chmod(0o644)


@pytest.mark.parametrize("size", [0, 1, 7])
def test_file_shorter_than_8_bytes(tmp_path, size):
    f = tmp_path / "short.safetensors"
    f.write_bytes(b"\x01" * size)
    with raises_naming(ValueError, f, "8-byte"):
        ple.Table.from_safetensors(f)


def test_header_length_larger_than_file(tmp_path):
    f = write_raw(tmp_path / "t.safetensors", {}, length=1000)
    with raises_naming(ValueError, f, "header length 1000"):
        ple.Table.from_safetensors(f)


def test_header_length_zero(tmp_path):
    f = write_raw(tmp_path / "t.safetensors", b"{}", length=0)
    with raises_naming(ValueError, f, "header length 0"):
        ple.Table.from_safetensors(f)


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe{}", b'{"a": '], ids=["syntax", "utf8", "cut"])
def test_header_not_json(tmp_path, raw):
    f = write_raw(tmp_path / "t.safetensors", raw)
    with raises_naming(ValueError, f, "corrupt safetensors header"):
        ple.Table.from_safetensors(f)


@pytest.mark.parametrize("obj", [[1, 2], "text", 3, None], ids=["list", "str", "int", "null"])
def test_header_not_object(tmp_path, obj):
    f = write_raw(tmp_path / "t.safetensors", obj)
    with raises_naming(ValueError, f, "not an object"):
        ple.Table.from_safetensors(f)


GOOD = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
BAD_ENTRIES = {
    "entry_list": [1, 2],
    "dtype_missing": {k: v for k, v in GOOD.items() if k != "dtype"},
    "dtype_int": {**GOOD, "dtype": 5},
    "shape_missing": {k: v for k, v in GOOD.items() if k != "shape"},
    "shape_str": {**GOOD, "shape": "2x3"},
    "shape_negative": {**GOOD, "shape": [-2, -3]},
    "shape_float": {**GOOD, "shape": [2.0, 3]},
    "shape_bool": {**GOOD, "shape": [True, 6], "data_offsets": [0, 24]},
    "offsets_missing": {k: v for k, v in GOOD.items() if k != "data_offsets"},
    "offsets_one": {**GOOD, "data_offsets": [0]},
    "offsets_reversed": {**GOOD, "data_offsets": [24, 0]},
    "offsets_negative": {**GOOD, "data_offsets": [-24, 0]},
    "offsets_str": {**GOOD, "data_offsets": ["0", "24"]},
}


@pytest.mark.parametrize("entry", list(BAD_ENTRIES.values()), ids=list(BAD_ENTRIES))
def test_bad_entry(tmp_path, entry):
    f = write_raw(tmp_path / "t.safetensors", {"good": GOOD, "broken": entry}, b"\0" * 48)
    with raises_naming(ValueError, f, "'broken'", "corrupt safetensors header"):
        ple.Table.from_safetensors(f, "good")


@pytest.mark.parametrize("offsets", [[0, 20], [0, 28], [4, 24]])
def test_offsets_span_not_matching_shape(tmp_path, offsets):
    f = write_raw(tmp_path / "t.safetensors", {"t": {**GOOD, "data_offsets": offsets}}, b"\0" * 48)
    with raises_naming(ValueError, f, "'t'", "F32 [2, 3] needs 24 bytes"):
        ple.Table.from_safetensors(f)


@pytest.mark.parametrize("cut", [1, 100])
def test_data_past_end_of_file(tmp_path, cut):
    f = write(tmp_path / "t.safetensors", {"a": torch.randn(10, 4), "tail": torch.randn(40, 4)})
    raw = f.read_bytes()
    f.write_bytes(raw[:-cut])
    with raises_naming(ValueError, f, "'tail'", "past the end"):
        ple.Table.from_safetensors(f, "a")


def test_data_offsets_past_end(tmp_path):
    f = write_raw(tmp_path / "t.safetensors",
                  {"t": {**GOOD, "data_offsets": [1000, 1024]}}, b"\0" * 24)
    with raises_naming(ValueError, f, "'t'", "past the end"):
        ple.Table.from_safetensors(f)


# --------------------------------------------------------------------------- errors: tables


def test_missing_tensor_name(tmp_path):
    f = write(tmp_path / "t.safetensors", {"a": torch.randn(3, 4), **shards(rows=(3, 3))})
    with raises_naming(ValueError, f, "'nope'"):
        ple.Table.from_safetensors(f, "nope")
    # A shard's full name is not a family prefix, a prefix with a dot is not either.
    with raises_naming(ValueError, f, "'emb.'"):
        ple.Table.from_safetensors(f, "emb.")


@pytest.mark.parametrize("shape", [(12,), (2, 3, 4), ()], ids=["1d", "3d", "0d"])
def test_tensor_not_2d(tmp_path, shape):
    f = write(tmp_path / "t.safetensors", {"bad": torch.randn(shape), "good": torch.randn(3, 4)})
    with raises_naming(ValueError, f, "'bad'", "not 2-D"):
        ple.Table.from_safetensors(f, "bad")


def test_shard_not_2d(tmp_path):
    s = shards()
    s["emb.shard_1.weight"] = torch.randn(97 * COLS)
    a = write(tmp_path / "a.safetensors", {"emb.shard_0.weight": s["emb.shard_0.weight"]})
    b = write(tmp_path / "b.safetensors", {k: v for k, v in s.items() if k != "emb.shard_0.weight"})
    with raises_naming(ValueError, b, "'emb.shard_1.weight'", "not 2-D"):
        ple.Table.from_safetensors([a, b])


def spread(tmp_path, s):
    """Each shard in its own file; returns the files."""
    return [write(tmp_path / f"part{i}.safetensors", {k: v}) for i, (k, v) in enumerate(s.items())]


def test_shards_of_different_widths(tmp_path):
    s = shards()
    s["emb.shard_2.weight"] = torch.randn(77, COLS + 1)
    files = spread(tmp_path, s)
    with raises_naming(ValueError, files[2], "'emb.shard_2.weight'", files[0],
                       "'emb.shard_0.weight'", "width"):
        ple.Table.from_safetensors(files)


def test_shards_of_different_dtypes(tmp_path):
    s = shards()
    s["emb.shard_1.weight"] = s["emb.shard_1.weight"].to(torch.float16)
    files = spread(tmp_path, s)
    with raises_naming(ValueError, files[1], "'emb.shard_1.weight'", "F16", "F32", files[0]):
        ple.Table.from_safetensors(files)


def test_shard_gap(tmp_path):
    s = shards(rows=(97, 97, 97, 77))
    del s["emb.shard_2.weight"]  # shards 0, 1, 3
    files = spread(tmp_path, s)
    # The files by their folder and count, and the one holding the shard before the gap.
    with raises_naming(ValueError, f"3 safetensors files in {tmp_path}: shard gap in 'emb'",
                       "shard 2 is missing (found shards [0, 1, 3]; shard 1 is in "
                       f"{files[1]})"):
        ple.Table.from_safetensors(files)


def test_shard_gap_no_shard_0(tmp_path):
    s = shards()
    del s["emb.shard_0.weight"]
    f = write(tmp_path / "t.safetensors", s)
    with raises_naming(ValueError, f, "'emb'", "shard 0 is missing"):
        ple.Table.from_safetensors(f)


def test_shard_index_written_two_ways(tmp_path):
    # "shard_1" and "shard_01" are both shard 1 of "emb": which one is meant is
    # ambiguous, so opening must fail rather than silently drop one of them.
    s = shards(rows=(5, 5))
    s["emb.shard_01.weight"] = torch.randn(3, COLS)
    f = write(tmp_path / "t.safetensors", s)
    with raises_naming(ValueError, f, "emb.shard_1.weight", "emb.shard_01.weight"):
        ple.Table.from_safetensors(f, "emb")


def test_middle_shard_shorter_than_first(tmp_path):
    files = spread(tmp_path, shards(rows=(97, 90, 77)))
    with raises_naming(ValueError, files[1], "'emb.shard_1.weight'", "90 rows", "97"):
        ple.Table.from_safetensors(files)


def test_middle_shard_longer_than_first(tmp_path):
    files = spread(tmp_path, shards(rows=(97, 98, 77)))
    with raises_naming(ValueError, files[1], "'emb.shard_1.weight'", "98 rows"):
        ple.Table.from_safetensors(files)


def test_last_shard_longer_than_first(tmp_path):
    files = spread(tmp_path, shards(rows=(97, 97, 100)))
    with raises_naming(ValueError, files[2], "'emb.shard_2.weight'", "100 rows"):
        ple.Table.from_safetensors(files)


def test_last_shard_may_equal_first(tmp_path):
    f = write(tmp_path / "t.safetensors", shards(rows=(50, 50, 50)))
    with ple.Table.from_safetensors(f) as table:
        assert table.num_rows == 150


@pytest.mark.parametrize("dtype,name", [(torch.float64, "F64"), (torch.int32, "I32"),
                                        (torch.int64, "I64"), (torch.bool, "BOOL"),
                                        (torch.float8_e5m2, "F8_E5M2")])
def test_unsupported_dtype(tmp_path, dtype, name):
    f = write(tmp_path / "t.safetensors", {"tab": torch.zeros(5, 4, dtype=dtype)})
    with raises_naming(ValueError, f, "'tab'", name, "not a supported"):
        ple.Table.from_safetensors(f)


def test_unsupported_dtype_family(tmp_path):
    f = write(tmp_path / "t.safetensors", shards(dtype=torch.float64))
    with raises_naming(ValueError, f, "'emb.shard_0.weight'", "F64"):
        ple.Table.from_safetensors(f, "emb")


def test_unknown_dtype_string(tmp_path):
    f = write_raw(tmp_path / "t.safetensors",
                  {"t": {"dtype": "X99", "shape": [2, 3], "data_offsets": [0, 6]}}, b"\0" * 6)
    with raises_naming(ValueError, f, "'t'", "X99"):
        ple.Table.from_safetensors(f)


def test_same_tensor_in_two_files(tmp_path):
    a = write(tmp_path / "a.safetensors", {"t": torch.randn(3, 4)})
    b = write(tmp_path / "b.safetensors", {"t": torch.randn(3, 4)})
    with raises_naming(ValueError, a, b, "'t'"):
        ple.Table.from_safetensors([a, b])
    with raises_naming(ValueError, a, b, "'t'"):
        ple.Table.from_safetensors(tmp_path)


def test_zero_width_table(tmp_path):
    f = write_raw(tmp_path / "t.safetensors",
                  {"t": {"dtype": "F32", "shape": [5, 0], "data_offsets": [0, 0]}})
    with raises_naming(ValueError, f, "'t'"):
        ple.Table.from_safetensors(f)


# --------------------------------------------------------------------------- close


def test_close(tmp_path):
    f = write(tmp_path / "t.safetensors", {"t": torch.randn(5, 4)})
    table = ple.Table.from_safetensors(f)
    handle = table.handle
    ids = torch.tensor([0, 1])
    assert gather(table, ids).shape == (2, 4)
    table.close()
    with pytest.raises(ValueError, match="closed"):
        table.handle
    closed = rf"ple table 't' \(handle {handle}\) is closed"
    with pytest.raises(ValueError, match=closed):
        torch.ops.ple.disk_gather(ids, handle)
    with pytest.raises(ValueError, match=closed):
        torch.ops.ple.disk_gather(ids, handle, torch.float16)
    with pytest.raises(ValueError, match=closed):
        torch.ops.ple.disk_gather_bytes(ids, handle)
    with pytest.raises(ValueError):
        table.gather_bytes(ids)
    with pytest.raises(ValueError):
        table.stats()
    table.close()  # twice is fine
    assert "closed" in repr(table)


def test_context_manager_closes(tmp_path):
    f = write(tmp_path / "t.safetensors", {"t": torch.randn(5, 4)})
    with ple.Table.from_safetensors(f) as table:
        handle = table.handle
    with pytest.raises(ValueError):
        table.handle
    with pytest.raises(ValueError, match=rf"\b{handle}\b"):
        torch.ops.ple.disk_gather(torch.tensor([0]), handle)


def test_context_manager_closes_on_exception(tmp_path):
    f = write(tmp_path / "t.safetensors", {"t": torch.randn(5, 4)})
    with pytest.raises(RuntimeError, match="boom"):
        with ple.Table.from_safetensors(f) as table:
            raise RuntimeError("boom")
    with pytest.raises(ValueError):
        table.handle


def test_closing_one_table_leaves_another_open(tmp_path):
    t = torch.randn(5, 4)
    f = write(tmp_path / "t.safetensors", {"t": t})
    a = ple.Table.from_safetensors(f)
    with ple.Table.from_safetensors(f) as b:
        a.close()
        assert torch.equal(gather(b, range(5)), t)


# --------------------------------------------------------------------------- GatherConfig


def test_config_defaults():
    c = GatherConfig()
    assert (c.policy, c.prefetch_window_kib, c.threads) == ("window", 4096, min(16, os.cpu_count()))


@pytest.mark.parametrize("policy", ple.POLICIES)
def test_config_policies(policy):
    assert GatherConfig(policy=policy).policy == policy


@pytest.mark.parametrize("kwargs,match", [
    ({"policy": "sometimes"}, "sometimes"),
    ({"policy": "WINDOW"}, "WINDOW"),
    ({"prefetch_window_kib": -1}, "prefetch_window_kib"),
    ({"threads": 0}, "threads"),
    ({"threads": -3}, "threads"),
    ({"threads": 2.0}, "threads"),
    ({"threads": "4"}, "threads"),
    ({"threads": True}, "threads"),
    ({"prefetch_window_kib": 1.5}, "prefetch_window_kib"),
    ({"prefetch_window_kib": None}, "prefetch_window_kib"),
])
def test_config_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GatherConfig(**kwargs)


def test_config_window_zero_ok():
    assert GatherConfig(prefetch_window_kib=0).prefetch_window_kib == 0


def test_config_from_spec():
    assert GatherConfig.from_spec("window:64", threads=3) == GatherConfig("window", 64, 3)
    assert GatherConfig.from_spec("none").prefetch_window_kib == GatherConfig().prefetch_window_kib
    with pytest.raises(ValueError, match="bad gather spec 'window:4k'"):
        GatherConfig.from_spec("window:4k")
    with pytest.raises(ValueError, match="unknown prefetch policy 'fast'"):
        GatherConfig.from_spec("fast:64")


def test_config_is_frozen():
    c = GatherConfig()
    with pytest.raises(Exception):
        c.threads = 8  # type: ignore[misc]


def test_table_config_setter(tmp_path):
    t = torch.randn(300, 4)
    f = write(tmp_path / "t.safetensors", {"t": t})
    custom = GatherConfig("distance", 16, 2)
    with ple.Table.from_safetensors(f, config=custom) as table:
        assert table.config == custom
        assert isinstance(table.config, GatherConfig)
        for c in (GatherConfig(), GatherConfig("none", 0, 1), GatherConfig("all", 8, 3)):
            table.config = c
            assert table.config is c
            assert torch.equal(gather(table, range(300)), t)
        before = table.config
        for bad in (None, {"policy": "window"}, ("window", 4096, 4), "window"):
            with pytest.raises(TypeError, match="GatherConfig"):
                table.config = bad
        assert table.config is before


def test_default_config(tmp_path):
    f = write(tmp_path / "t.safetensors", {"t": torch.randn(3, 4)})
    with ple.Table.from_safetensors(f) as table:
        assert table.config == GatherConfig()


@pytest.mark.parametrize("header, message", [
    ({"t": {"dtype": "U8", "shape": [0, 2**50], "data_offsets": [0, 0]}},
     f"has rows of {2**50} bytes, more than {2**48}"),
    ({"t": {"dtype": "F32", "shape": [3, 0], "data_offsets": [0, 0]}}, "has rows of no values"),
])
def test_rows_too_wide_or_of_no_values(tmp_path, header, message):
    f = write_raw(tmp_path / "t.safetensors", header)
    with raises_naming(ValueError, f, "tensor 't'", message):
        ple.Table.from_safetensors(f)
