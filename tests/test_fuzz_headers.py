"""Malformed safetensors files (hypothesis): opening one is a ValueError or an
OSError naming the file, or, when the corruption happens to leave a valid
file, a table whose every row can be gathered.  Never another exception,
never a crash, never a hang.

The starting points are two valid files written by the safetensors package: a
single U8 tensor ``t`` with its ``t_scale`` and a 1-D neighbour, and a 3-shard
family ``f.shard_{0,1,2}.weight`` with ``f.weight_scale``.  The corruptions:
bytes of the 8-byte length and of the JSON header flipped or overwritten; the
parsed header's entries changed (offsets, shapes, dtypes, whole entries, keys,
names) and re-serialized with an exact, stale or arbitrary length; the file
truncated anywhere, exact region boundaries included.

Corner cases the random search is unlikely to reach are at the end, written
out by hand.  ``PLE_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_headers.py``
searches longer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

import ple

EXAMPLES = int(os.environ.get("PLE_FUZZ_EXAMPLES", 150))
# database=None: no .hypothesis directory in the repository.  The same
# examples every run (derandomize) unless PLE_FUZZ_EXAMPLES asks for a search.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize="PLE_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
HANG_SECONDS = 60  # one open of a tiny file that takes longer than this has hung


def _base(kind: str) -> bytes:
    gen = torch.Generator().manual_seed(0)
    if kind == "single":
        tensors = {
            "t": torch.randint(0, 256, (7, 12), generator=gen, dtype=torch.uint8),
            "t_scale": torch.tensor(0.5, dtype=torch.float32),
            "neighbour": torch.randint(0, 256, (13,), generator=gen, dtype=torch.uint8),
        }
    else:
        tensors = {f"f.shard_{i}.weight": torch.randint(0, 256, (n, 8), generator=gen,
                                                        dtype=torch.uint8)
                   for i, n in enumerate((5, 5, 3))}
        tensors["f.weight_scale"] = torch.tensor(0.25, dtype=torch.bfloat16)
    return save(tensors, metadata={"format": "pt"})


BASES = {kind: _base(kind) for kind in ("single", "family")}
INTENDED = {"single": "t", "family": "f"}


def _split(raw: bytes) -> tuple[int, dict, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8:8 + length]), raw[8 + length:]


# ---------------------------------------------------------------- the check


@contextlib.contextmanager
def _hang_guard(seconds: int = HANG_SECONDS):
    """Turns a hang in Python code into a TimeoutError instead of a stuck run."""
    def alarm(signum, frame):
        raise TimeoutError(f"opening or gathering took more than {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _rows_in_file(raw: bytes, table: ple.Table) -> np.ndarray:
    """The table's rows read straight from the file's bytes, by our own reading
    of the header (the same JSON the table was opened from)."""
    length, header, _ = _split(raw)
    if len(table.shard_rows) == 1 and table.name in header:
        names = [table.name]
    else:
        names = [f"{table.name}.shard_{i}.weight" for i in range(len(table.shard_rows))]
    parts = []
    for name in names:
        begin, end = header[name]["data_offsets"]
        parts.append(np.frombuffer(raw[8 + length + begin:8 + length + end], dtype=np.uint8))
    return np.concatenate(parts).reshape(table.num_rows, table.row_bytes)


def _check(raw: bytes, kind: str) -> None:
    """Writes ``raw`` and opens it, with and without tensor=: a ValueError or
    OSError naming the file, or a table whose every row gathers correctly."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{kind}.safetensors"
        path.write_bytes(raw)
        for tensor in (None, INTENDED[kind]):
            with _hang_guard():
                try:
                    table = ple.Table.from_safetensors(path, tensor)
                except (ValueError, OSError) as error:
                    assert str(path) in str(error), (
                        f"{type(error).__name__} does not name the file: {error}")
                    continue
                except Exception as error:  # noqa: BLE001  (the failure this test looks for)
                    raise AssertionError(
                        f"from_safetensors({tensor!r}) raised {type(error).__name__}, not "
                        f"ValueError/OSError: {error}") from error
                with table:
                    ids = torch.arange(table.num_rows)
                    got = table.gather_bytes(ids)
                    assert np.array_equal(got.numpy(), _rows_in_file(raw, table))
                    values = torch.ops.ple.disk_gather(ids, table.handle)
                    assert values.shape == (table.num_rows, table.cols)


# ---------------------------------------------------------------- raw bytes

INTERESTING_BYTES = [ord(c) for c in '"{}[],:-09.e\\ '] + [0x00, 0x7F, 0x80, 0xC0, 0xFF]


@st.composite
def byte_edits(draw, length: int):
    """(position, new byte function) edits of the length field or the header."""
    region = draw(st.sampled_from(["length", "header", "header", "header"]))
    position = draw(st.integers(0, 7)) if region == "length" else 8 + draw(st.integers(0, length - 1))
    how = draw(st.sampled_from(["xor", "set", "interesting"]))
    if how == "xor":
        value = draw(st.sampled_from([1 << k for k in range(8)] + [0xFF]))
    elif how == "set":
        value = draw(st.integers(0, 255))
    else:
        value = draw(st.sampled_from(INTERESTING_BYTES))
    return position, how, value


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(BASES)))
def test_corrupt_length_and_header_bytes(data, kind):
    raw = bytearray(BASES[kind])
    length, _, _ = _split(bytes(raw))
    for position, how, value in data.draw(st.lists(byte_edits(length), min_size=1, max_size=4)):
        raw[position] = raw[position] ^ value if how == "xor" else value
    _check(bytes(raw), kind)


# ---------------------------------------------------------------- the parsed header

DTYPES = ["BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "U16", "I16", "F16", "BF16", "U32", "I32",
          "F32", "U64", "I64", "F64", "XX", "", "u8", "F32 ", "I4", "C64"]
HUGE = [-1, -(2**63), 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30]
NOT_INTS = [None, "1", 1.0, 2.5, True, False, [], {}]
NOT_DICTS = [None, 0, 7, "entry", [], [1, 2], True, 1.5]


def ints(high: int):
    return st.one_of(st.integers(-3, high + 3), st.sampled_from(HUGE), st.integers())


def offsets(high: int):
    return st.one_of(
        st.lists(ints(high), min_size=2, max_size=2),
        st.lists(ints(high), max_size=3),
        st.lists(st.one_of(ints(high), st.sampled_from(NOT_INTS)), min_size=2, max_size=2),
        st.sampled_from(NOT_INTS + ["0,8"]),
    )


def shapes():
    dim = st.one_of(st.integers(-2, 40), st.sampled_from(HUGE))
    return st.one_of(
        st.lists(dim, min_size=2, max_size=2),
        st.lists(dim, max_size=4),
        st.lists(st.one_of(dim, st.sampled_from(NOT_INTS)), min_size=1, max_size=3),
        st.sampled_from(NOT_INTS + ["7x12"]),
    )


def new_names(kind: str):
    # Small shard indices only: a huge one is the hand-written case below.
    return st.sampled_from(
        ["t", "t2", "t_scale", "f", "f.weight_scale", "__metadata__", "", "x.shard_0.weight",
         "t.shard_0.weight", "t.shard_1.weight", "f.shard_00.weight", "f.shard_2.weight",
         "f.shard_3.weight", "f.shard_5.weight", "f.shard_0.weight", "f.shard_1.weight",
         "f.shard_-1.weight", "f.shard_x.weight", "f.weight"])


@st.composite
def header_edits(draw, kind: str, header: dict, data_len: int):
    # The table's own tensors twice as often as the others.
    tables = [n for n in header if n.startswith(INTENDED[kind])
              and "scale" not in n]
    name = draw(st.sampled_from(sorted(header) + tables))
    what = draw(st.sampled_from(["offsets", "shape", "dtype", "entry", "drop_key", "extra_key",
                                 "rename", "delete", "resize", "alias"]))
    if what == "offsets":
        return what, name, draw(offsets(data_len))
    if what == "shape":
        return what, name, draw(shapes())
    if what == "dtype":
        return what, name, draw(st.one_of(st.sampled_from(DTYPES), st.sampled_from(NOT_INTS[:4])))
    if what == "entry":
        return what, name, draw(st.sampled_from(NOT_DICTS))
    if what == "drop_key":
        return what, name, draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
    if what == "extra_key":
        return what, name, draw(st.sampled_from(["extra", "dtype2", ""]))
    if what == "rename":
        return what, name, draw(new_names(kind))
    if what == "delete":
        return what, name, None
    if what == "resize":  # shape and offsets changed together: often a valid entry
        rows = draw(st.one_of(st.just(0), st.integers(0, 12), st.sampled_from([2**32, 2**63, 2**64])))
        cols = draw(st.one_of(st.integers(0, 16), st.sampled_from([2**32, 2**62, 2**63, 2**64])))
        begin = draw(st.integers(0, data_len))
        dtype = draw(st.sampled_from(["U8", "I8", "F8_E4M3", "F16", "BF16", "F32", "F64"]))
        return what, name, (rows, cols, begin, dtype)
    return what, name, draw(st.sampled_from(sorted(header)))  # alias: another entry's offsets


ITEMSIZE = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def _apply(header: dict, edit) -> None:
    what, name, arg = edit
    if name not in header:
        return  # renamed or deleted by an earlier edit
    entry = header[name]
    if what == "entry":
        header[name] = arg
    elif what == "delete":
        del header[name]
    elif what == "rename":
        header[arg] = header.pop(name)
    elif not isinstance(entry, dict):
        return
    elif what == "offsets":
        entry["data_offsets"] = arg
    elif what == "shape":
        entry["shape"] = arg
    elif what == "dtype":
        entry["dtype"] = arg
    elif what == "drop_key":
        entry.pop(arg, None)
    elif what == "extra_key":
        entry[arg] = [1, 2]
    elif what == "resize":
        rows, cols, begin, dtype = arg
        entry.update(dtype=dtype, shape=[rows, cols],
                     data_offsets=[begin, begin + rows * cols * ITEMSIZE[dtype]])
    elif what == "alias" and isinstance(header.get(arg), dict):
        entry["data_offsets"] = header[arg].get("data_offsets")


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(BASES)))
def test_corrupt_header_entries(data, kind):
    length, header, body = _split(BASES[kind])
    edits = data.draw(st.lists(header_edits(kind, header, len(body)), min_size=1, max_size=3))
    for edit in edits:
        _apply(header, edit)
    text = json.dumps(header).encode()
    how = data.draw(st.sampled_from(["exact"] * 4 + ["padded", "stale", "delta", "any"]))
    if how == "padded":  # trailing spaces inside the length: still valid
        text += b" " * data.draw(st.integers(1, 16))
    new_length = {
        "exact": len(text), "padded": len(text), "stale": length,
        "delta": len(text) + data.draw(st.integers(-8, 8)),
        "any": data.draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 2 * len(text)))),
    }[how] % 2**64
    _check(struct.pack("<Q", new_length) + text + body, kind)


# ---------------------------------------------------------------- truncation


def _boundaries(raw: bytes) -> list[int]:
    length, header, _ = _split(raw)
    cuts = {0, 1, 7, 8, 9, 8 + length - 1, 8 + length, 8 + length + 1, len(raw) - 1, len(raw)}
    for info in header.values():
        if isinstance(info, dict) and "data_offsets" in info:
            for offset in info["data_offsets"]:
                cuts.update(8 + length + offset + d for d in (-1, 0, 1))
    return sorted(c for c in cuts if 0 <= c <= len(raw))


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(BASES)))
def test_truncated_files(data, kind):
    raw = BASES[kind]
    length, _, _ = _split(raw)
    cut = data.draw(st.one_of(
        st.sampled_from(_boundaries(raw)),
        st.integers(0, 7),                       # inside the length
        st.integers(8, 8 + length),              # inside the header
        st.integers(8 + length, len(raw)),       # inside the data
    ))
    _check(raw[:cut], kind)


def test_every_truncation_point():
    """Not random: the family file cut at every byte."""
    raw = BASES["family"]
    for cut in range(len(raw) + 1):
        _check(raw[:cut], "family")


def test_bases_are_valid():
    for kind, raw in BASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "x.safetensors"
            path.write_bytes(raw)
            with ple.Table.from_safetensors(path) as table:
                assert table.name == INTENDED[kind]
                assert table.scale == {"single": 0.5, "family": 0.25}[kind]
        _check(raw, kind)


# ---------------------------------------------------------------- by hand


def _raw(header, data: bytes = b"\0" * 64) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _open_expecting_value_error(tmp_path, raw: bytes, tensor=None) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw)
    with _hang_guard():
        with pytest.raises(ValueError) as info:
            ple.Table.from_safetensors(path, tensor)
    assert str(path) in str(info.value), str(info.value)[:500]


@pytest.mark.parametrize("nesting", [b"[", b'{"a":'], ids=["array", "object"])
def test_deeply_nested_header(tmp_path, nesting):
    """A header of 100,000 nested arrays/objects is a corrupt header, a
    ValueError naming the file (json.loads raises RecursionError)."""
    _open_expecting_value_error(tmp_path, _raw(nesting * 100_000))


def test_header_integer_of_too_many_digits(tmp_path):
    """A data offset of 5,000 digits: json.loads raises a ValueError of its own
    ("Exceeds the limit (4300 digits)"), which must still name the file."""
    text = b'{"t": {"dtype": "U8", "shape": [2, 4], "data_offsets": [0, 1' + b"0" * 5000 + b"]}}"
    _open_expecting_value_error(tmp_path, _raw(text))


@pytest.mark.parametrize("dtype,cols", [("U8", 2**63), ("U8", 2**64), ("F32", 2**62)])
def test_zero_rows_of_a_width_beyond_int64(tmp_path, dtype, cols):
    """Shape [0, cols] spans 0 bytes, so the header is consistent, but
    cols x itemsize does not fit the native int64 row_bytes."""
    raw = _raw({"t": {"dtype": dtype, "shape": [0, cols], "data_offsets": [0, 0]}})
    _open_expecting_value_error(tmp_path, raw)


def test_huge_shard_index(tmp_path):
    """``f.shard_1000000000000000.weight`` next to shard 0 is a shard gap, found
    at once: no set of every index up to it.  Run in a child with its address
    space capped, so that a regression fails fast instead of eating memory."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(_raw({
        "f.shard_0.weight": {"dtype": "U8", "shape": [2, 4], "data_offsets": [0, 8]},
        f"f.shard_{10**15}.weight": {"dtype": "U8", "shape": [2, 4], "data_offsets": [8, 16]},
    }))
    script = (
        "import resource, sys, ple\n"
        "vm = [l for l in open('/proc/self/status') if l.startswith('VmSize')][0]\n"
        "cap = int(vm.split()[1]) * 1024 + (1 << 30)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (cap, cap))\n"
        "try:\n"
        "    ple.Table.from_safetensors(sys.argv[1])\n"
        "except BaseException as e:\n"
        "    print(type(e).__name__, sys.argv[1] in str(e))\n")
    try:
        result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                                text=True, timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"opening a file with a huge shard index did not finish in {HANG_SECONDS} s")
    assert result.stdout.split() == ["ValueError", "True"], (result.stdout, result.stderr[-2000:])
