"""Malformed safetensors and GGUF files (hypothesis): opening one is a
ValueError or an OSError naming the file, or, when the corruption happens to
leave a valid file, a table whose every row can be gathered (for GGUF: whose
rows are the gguf reader's, at an offset inside the file's data section).
Never another exception, never a crash, never a hang.  The GGUF half is
described where it starts, below the safetensors half.

For safetensors, the starting points are two valid files written by the
safetensors package: a single U8 tensor ``t`` with its ``t_scale`` and a 1-D
neighbour, and a 3-shard family ``f.shard_{0,1,2}.weight`` with
``f.weight_scale``.  The corruptions:
bytes of the 8-byte length and of the JSON header flipped or overwritten; the
parsed header's entries changed (offsets, shapes, dtypes, whole entries, keys,
names) and re-serialized with an exact, stale or arbitrary length; the file
truncated anywhere, exact region boundaries included.

Corner cases the random search is unlikely to reach, and the failing inputs
it found, are written out by hand at the end of each half.
``PLE_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_headers.py`` searches longer
(and with fresh random examples).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
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


def _open_or_named_error(open_table, path: Path, call: str, must_open: bool = False):
    """The table ``open_table()`` opens, or None when it raised ValueError or
    OSError naming ``path``; any other exception fails the test."""
    try:
        return open_table()
    except (ValueError, OSError) as error:
        assert not must_open, f"a valid file did not open: {error}"
        assert str(path) in str(error), f"{type(error).__name__} does not name the file: {error}"
        return None
    except Exception as error:  # noqa: BLE001  (the failure these tests look for)
        raise AssertionError(f"{call} raised {type(error).__name__}, not ValueError/OSError: "
                             f"{error}") from error


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
                table = _open_or_named_error(lambda: ple.Table.from_safetensors(path, tensor), path,
                                             f"from_safetensors({tensor!r})")
                if table is None:
                    continue
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


# ================================================================ GGUF
#
# Malformed GGUF files, structure-aware.  The starting points are two small
# files written by gguf.GGUFWriter (the layout below reads where every field of
# them is with gguf.GGUFReader): "plain" (default alignment 32; tensors t Q8_0
# 5x64, f F32 3x8, a 1-D v, h F16 4x16; string and array key-values) and
# "aligned" (general.alignment = 64; t, f, v).  The corruptions: single fields
# of the header overwritten in place (version, counts, key-value types and
# lengths, array counts, the alignment, and every field of every tensor info:
# name length and bytes, n_dims, each dimension, the type, the data offset);
# whole tensor infos and key-values rewritten with consistent framing and the
# file re-serialized (names, dimension lists, types, offsets, the alignment
# key's type and value, duplicate and reserved keys); bytes flipped in a chosen
# region; the file cut at every region boundary and inside every region.  Each
# case opens t, f (and h) with Table.from_gguf and, when one opens, checks its
# rows byte for byte against the reader's data and against the bytes at the
# offset it parsed (in Python ints, inside the data section), and its values
# against gguf.quants.dequantize, and that no two tensors of the file share a
# byte by the reader's offsets.


GGUF_ALIGNMENT = {"plain": 32, "aligned": 64}
GGUF_TABLES = {"plain": ("t", "f", "h"), "aligned": ("t", "f")}
U64 = 2**64


def _gguf_base(kind: str) -> bytes:
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "base.gguf"
        writer = gguf.GGUFWriter(str(path), "test")
        if kind == "aligned":
            writer.add_custom_alignment(64)
        writer.add_array("test.numbers", [1, 2, 3])
        writer.add_array("test.words", ["a", "bc"])
        values = rng.uniform(-2, 2, (5, 64)).astype(np.float32)
        writer.add_tensor("t", gguf.quants.quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
        writer.add_tensor("f", rng.uniform(-2, 2, (3, 8)).astype(np.float32))
        writer.add_tensor("v", np.arange(5, dtype=np.float32))
        if kind == "plain":
            writer.add_tensor("h", rng.uniform(-2, 2, (4, 16)).astype(np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes()


def _as_file(raw: bytes):
    handle = tempfile.TemporaryFile()
    handle.write(raw)
    handle.flush()
    return handle


def _spans(field, start: int) -> list[tuple[int, int]]:
    """(start, width) of each of a reader field's parts, which lie in order."""
    spans = []
    for part in field.parts:
        spans.append((start, int(part.nbytes)))
        start += int(part.nbytes)
    return spans


@dataclasses.dataclass
class GGUFLayout:
    """Where everything of a valid GGUF file is, read with gguf.GGUFReader."""
    raw: bytes
    version: int
    kvs: list  # (key bytes, value type, value bytes), in file order
    kv_spans: list  # per key-value: {"key_len", "key", "type", "value": (start, width)} and "parts"
    infos: list  # per tensor: {"name", "dims", "type", "offset"} (values)
    info_spans: list  # per tensor: {"name_len", "name", "n_dims", "dims": [...], "type", "offset"}
    infos_start: int
    infos_end: int
    data_offset: int
    alignment: int

    @property
    def data(self) -> bytes:
        return self.raw[self.data_offset:]

    def regions(self) -> dict[str, tuple[int, int]]:
        """Named [begin, end) byte ranges covering the file."""
        out = {"magic": (0, 4), "version": (4, 8), "tensor_count": (8, 16), "kv_count": (16, 24)}
        for i, spans in enumerate(self.kv_spans):
            for part in ("key_len", "key", "type", "value"):
                start, width = spans[part]
                out[f"kv{i}.{part}"] = (start, start + width)
        for info, spans in zip(self.infos, self.info_spans):
            for part in ("name_len", "name", "n_dims", "type", "offset"):
                start, width = spans[part]
                out[f"{info['name']}.{part}"] = (start, start + width)
            if spans["dims"]:
                out[f"{info['name']}.dims"] = (spans["dims"][0][0], spans["dims"][-1][0] + 8)
        out["padding"] = (self.infos_end, self.data_offset)
        for info in self.infos:
            begin = self.data_offset + info["offset"]
            out[f"{info['name']}.data"] = (begin, begin + info["nbytes"])
        out["end"] = (len(self.raw), len(self.raw))
        return out


def _gguf_layout(raw: bytes) -> GGUFLayout:
    with _as_file(raw) as handle:
        reader = GGUFReader(handle)
        kvs, kv_spans = [], []
        for field in list(reader.fields.values())[3:]:  # after GGUF.version and the counts
            spans = _spans(field, field.offset)
            end = spans[-1][0] + spans[-1][1]
            kv_spans.append({"key_len": spans[0], "key": spans[1], "type": spans[2],
                             "value": (spans[3][0], end - spans[3][0]), "parts": spans[3:]})
            kvs.append((raw[spans[1][0]:spans[1][0] + spans[1][1]], int(field.types[0]),
                        raw[spans[3][0]:end]))
        infos, info_spans = [], []
        for tensor in reader.tensors:
            name_len, name, n_dims, dims, kind, offset = _spans(tensor.field, tensor.field.offset)
            info_spans.append({"name_len": name_len, "name": name, "n_dims": n_dims,
                               "dims": [(dims[0] + 8 * j, 8) for j in range(dims[1] // 8)],
                               "type": kind, "offset": offset})
            infos.append({"name": tensor.name, "dims": [int(d) for d in tensor.shape],
                          "type": int(tensor.tensor_type),
                          "offset": int(tensor.field.parts[5][0]), "nbytes": int(tensor.n_bytes)})
        last = info_spans[-1]["offset"]
        return GGUFLayout(raw, int(reader.fields["GGUF.version"].parts[0][0]), kvs, kv_spans,
                          infos, info_spans, info_spans[0]["name_len"][0], last[0] + last[1],
                          int(reader.data_offset), int(reader.alignment))


GGUF_BASES = {kind: _gguf_base(kind) for kind in ("plain", "aligned")}
GGUF_LAYOUTS = {kind: _gguf_layout(raw) for kind, raw in GGUF_BASES.items()}
# Where the plain file's tensors lie in its data section: (offset, bytes).
PLAIN_SPANS = {"t": (0, 340), "f": (352, 96), "v": (448, 20), "h": (480, 128)}


def _serialize(version: int, kvs, infos, data: bytes, alignment: int, *, counts=(None, None),
               padding: str = "aligned") -> bytes:
    """A GGUF file from parts: kvs are (key bytes, type, value bytes), infos
    {"name": bytes, "dims": [...], "type", "offset"}; ``counts`` overrides the
    tensor and key-value counts; ``padding`` "aligned" pads the header to
    ``alignment``, "none" not at all, "extra" one alignment more."""
    out = bytearray(b"GGUF")
    out += struct.pack("<I", version % 2**32)
    out += struct.pack("<Q", (len(infos) if counts[0] is None else counts[0]) % U64)
    out += struct.pack("<Q", (len(kvs) if counts[1] is None else counts[1]) % U64)
    for key, kind, value in kvs:
        out += struct.pack("<Q", len(key)) + key + struct.pack("<I", kind % 2**32) + value
    for info in infos:
        name = info["name"]
        out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(info["dims"]) % 2**32)
        for dim in info["dims"]:
            out += struct.pack("<Q", dim % U64)
        out += struct.pack("<I", info["type"] % 2**32) + struct.pack("<Q", info["offset"] % U64)
    if padding != "none":
        out += b"\0" * (-len(out) % alignment + (alignment if padding == "extra" else 0))
    return bytes(out + data)


def _reserialized(layout: GGUFLayout) -> bytes:
    infos = [dict(info, name=info["name"].encode()) for info in layout.infos]
    return _serialize(layout.version, layout.kvs, infos, layout.data, layout.alignment)


def test_gguf_bases_are_valid():
    for kind, raw in GGUF_BASES.items():
        layout = GGUF_LAYOUTS[kind]
        assert layout.alignment == GGUF_ALIGNMENT[kind]
        assert _reserialized(layout) == raw  # the serializer writes what GGUFWriter wrote
        if kind == "plain":
            assert {i["name"]: (i["offset"], i["nbytes"]) for i in layout.infos} == PLAIN_SPANS
        _check_gguf(raw, kind, must_open=True)


# ---------------------------------------------------------------- the check


def _gguf_rows(raw: bytes, path: Path, name: str, table: ple.Table):
    """The rows of ``name`` by gguf.GGUFReader, and by our own reading of the
    offset it parsed (Python ints: no uint64 wrap-around), which must agree
    and lie inside the data section of the file."""
    reader = GGUFReader(path)
    (tensor,) = [t for t in reader.tensors if t.name == name]
    assert tuple(int(d) for d in reversed(tensor.shape.tolist())) == (table.num_rows, table.cols)
    nbytes = table.num_rows * table.row_bytes
    assert int(tensor.n_bytes) == nbytes
    begin = int(reader.data_offset) + int(tensor.field.parts[5][0])
    assert int(reader.data_offset) <= begin and begin + nbytes <= len(raw), (
        f"{name!r} opened with data at bytes {begin} to {begin + nbytes} of a {len(raw)}-byte "
        f"file whose data section starts at {int(reader.data_offset)}")
    ours = np.frombuffer(raw[begin:begin + nbytes], dtype=np.uint8)
    theirs = np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8)
    assert np.array_equal(ours, theirs), "the reader's data is not the bytes at its offset"
    # Sorted by where they begin, tensors that share a byte include two neighbours that do.
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes))
                   for t in reader.tensors if t.n_bytes)
    assert all(end <= begin for (_, end), (begin, _) in zip(spans, spans[1:])), (
        f"opened a file whose tensors share bytes: {spans}")
    return ours.reshape(table.num_rows, table.row_bytes), Q(int(tensor.tensor_type))


def _check_gguf(raw: bytes, kind: str, must_open: bool = False, names=None) -> None:
    """Writes ``raw`` and opens each of the kind's tables from it: a ValueError
    or OSError naming the file, or a table whose rows, bytes and values, are
    the reader's for those rows."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{kind}.gguf"
        path.write_bytes(raw)
        for tensor in names or GGUF_TABLES[kind]:
            with _hang_guard():
                table = _open_or_named_error(lambda: ple.Table.from_gguf(path, tensor), path,
                                             f"from_gguf({tensor!r})", must_open)
                if table is None:
                    continue
                with table:
                    ids = torch.arange(table.num_rows)
                    got = table.gather_bytes(ids)
                    rows, qtype = _gguf_rows(raw, path, tensor, table)
                    assert np.array_equal(got.numpy(), rows)
                    if table.num_rows:
                        with np.errstate(all="ignore"):  # random blocks decode to inf and nan
                            values = torch.ops.ple.disk_gather(ids, table.handle, torch.float32)
                            want = torch.from_numpy(
                                np.array(gguf.quants.dequantize(rows, qtype), dtype=np.float32))
                        torch.testing.assert_close(values, want.float(), rtol=0, atol=0,
                                                   equal_nan=True)


# ---------------------------------------------------------------- fields in place

TYPES_DECODED = [0, 1, 30, 8, 2, 20, 12, 14]
TYPES_NOT_DECODED = [3, 6, 7, 9, 10, 11, 13, 15, 16, 19, 23, 24, 25, 26, 27, 28, 29, 34, 39, 41]
TYPES_UNKNOWN = [4, 5, 31, 32, 33, 36, 37, 38, 42, 255, 2**16, 2**31, 2**32 - 1]
U64_SPECIAL = [0, 1, 2, 3, 31, 32, 33, 63, 64, 65, 255, 256, 257, 2**31 - 1, 2**31, 2**32 - 1,
               2**32, 2**32 + 1, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**63 + 1, U64 - 32,
               U64 - 2, U64 - 1]
U32_SPECIAL = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1]


def _u64s(*extra):
    return st.one_of(st.sampled_from(U64_SPECIAL + list(extra)), st.integers(0, 300),
                     st.integers(0, U64 - 1))


def _u32s(*extra):
    return st.one_of(st.sampled_from(U32_SPECIAL + list(extra)), st.integers(0, 64),
                     st.integers(0, 2**32 - 1))


def _types():
    return st.one_of(st.sampled_from(TYPES_DECODED), st.sampled_from(TYPES_NOT_DECODED),
                     st.sampled_from(TYPES_UNKNOWN), st.integers(0, 2**32 - 1))


def _dims():
    return st.one_of(st.sampled_from([0, 1, 2, 3, 5, 8, 16, 31, 32, 33, 64, 96, 128, 256, 512]),
                     st.integers(0, 600), _u64s())


def _offsets(layout: GGUFLayout, index: int):
    """Data offsets that matter: other tensors' (overlap), misaligned, the end
    of the data and just past it, huge, negative as int64, and those that wrap
    around 2**64 back into the header when added to the data section's start."""
    own = layout.infos[index]
    data_len = len(layout.raw) - layout.data_offset
    special = [0, own["offset"] + 1, own["offset"] - 1, own["offset"] + layout.alignment,
               own["offset"] + layout.alignment // 2, data_len, data_len + 1,
               data_len - own["nbytes"], data_len - own["nbytes"] + 1,
               data_len - own["nbytes"] - 1, U64 - layout.data_offset,
               U64 - layout.data_offset + layout.infos_start,
               U64 - layout.data_offset + own["offset"] + layout.alignment]
    special += [info["offset"] for info in layout.infos]
    return st.one_of(st.sampled_from([s % U64 for s in special]), st.integers(0, data_len + 64),
                     _u64s())


def _field_targets(layout: GGUFLayout) -> list[tuple[str, tuple[int, int], str, int]]:
    """(label, (start, width), what, tensor index) of every numeric field; the
    tensor infos' fields are listed three times, so drawn most."""
    targets = [("version", (4, 4), "version", -1), ("tensor_count", (8, 8), "count", -1),
               ("kv_count", (16, 8), "count", -1)]
    for i, spans in enumerate(layout.kv_spans):
        key = layout.kvs[i][0].decode()
        targets += [(f"{key}.key_len", spans["key_len"], "length", -1),
                    (f"{key}.type", spans["type"], "kv_type", -1)]
        if layout.kvs[i][1] == gguf.GGUFValueType.ARRAY:
            targets += [(f"{key}.item_type", spans["parts"][0], "kv_type", -1),
                        (f"{key}.item_count", spans["parts"][1], "count", -1)]
        elif layout.kvs[i][1] == gguf.GGUFValueType.STRING:
            targets.append((f"{key}.length", spans["parts"][0], "length", -1))
        if key == "general.alignment":
            targets += [("alignment", spans["value"], "alignment", -1)] * 3
    for i, spans in enumerate(layout.info_spans):
        name = layout.infos[i]["name"]
        fields = [(f"{name}.name_len", spans["name_len"], "length", i),
                  (f"{name}.name", spans["name"], "name_byte", i),
                  (f"{name}.n_dims", spans["n_dims"], "n_dims", i),
                  (f"{name}.type", spans["type"], "type", i),
                  (f"{name}.offset", spans["offset"], "offset", i)]
        fields += [(f"{name}.dim{j}", span, "dim", i) for j, span in enumerate(spans["dims"])]
        targets += fields * 3
    return targets


GGUF_TARGETS = {kind: _field_targets(layout) for kind, layout in GGUF_LAYOUTS.items()}


@st.composite
def gguf_field_edits(draw, kind: str):
    layout = GGUF_LAYOUTS[kind]
    label, (start, width), what, index = draw(st.sampled_from(GGUF_TARGETS[kind]))
    if what == "name_byte":
        position = start + draw(st.integers(0, width - 1))
        return label, (position, 1), draw(st.sampled_from([0x00, 0x80, 0xC0, 0xFF, ord("f"),
                                                           ord("t"), ord("."), 0xED]))
    value = draw({
        "version": st.one_of(st.sampled_from([0, 1, 2, 3, 4, 0x00020000, 0x00030000,
                                              0x03000000]), _u32s()),
        "count": _u64s(len(layout.infos) + 1, len(layout.kvs) + 1, len(layout.raw) // 32),
        "length": _u64s(len(layout.raw)),
        "kv_type": st.one_of(st.integers(0, 13), _u32s()),
        "alignment": st.one_of(st.sampled_from([0, 1, 3, 8, 16, 24, 32, 48, 96, 128, 4096,
                                                2**20, 2**31, 2**32 - 1]), _u32s()),
        "n_dims": st.one_of(st.integers(0, 6), _u32s()),
        "type": _types(),
        "dim": _dims(),
        "offset": _offsets(layout, index) if what == "offset" else st.nothing(),
    }[what])
    return label, (start, width), value % 2 ** (8 * width)


def _put(raw: bytearray, span: tuple[int, int], value: int) -> None:
    start, width = span
    raw[start:start + width] = value.to_bytes(width, "little")


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(GGUF_BASES)))
def test_gguf_corrupt_fields(data, kind):
    raw = bytearray(GGUF_BASES[kind])
    for _, span, value in data.draw(st.lists(gguf_field_edits(kind), min_size=1, max_size=3)):
        _put(raw, span, value)
    _check_gguf(bytes(raw), kind)


# ---------------------------------------------------------------- rewritten

NAMES = [b"", b"t", b"f", b"v", b"h", b"x", b"t\x00", b"\xff", b"t\xff", b"\xc0\x80",
         b"\xed\xa0\x80", "é".encode(), b"GGUF.version", b"y" * 300]
KEYS = [b"", b"general.alignment", b"general.architecture", b"GGUF.version", b"GGUF.kv_count",
        b"test.numbers", b"\xff\xfe", b"k" * 70]


@st.composite
def gguf_value(draw):
    """A key-value's (type, value bytes), often one the alignment key can take."""
    kind = draw(st.sampled_from(["u32", "u32", "u64", "i32", "u8", "u16", "string", "array",
                                 "f32", "bool", "unknown"]))
    number = draw(st.one_of(st.sampled_from([0, 1, 3, 16, 32, 48, 64, 128, 4096, 2**31,
                                             2**32 - 1]), st.integers(0, 2**32 - 1)))
    if kind == "u32":
        return 4, struct.pack("<I", number)
    if kind == "u64":
        return 10, struct.pack("<Q", number)
    if kind == "i32":
        return 5, struct.pack("<I", number)
    if kind == "u8":
        return 0, bytes([number % 256])
    if kind == "u16":
        return 2, struct.pack("<H", number % 2**16)
    if kind == "f32":
        return 6, struct.pack("<f", float(number))
    if kind == "bool":
        return 7, bytes([number % 2])
    if kind == "string":
        text = str(number).encode()
        return 8, struct.pack("<Q", len(text)) + text
    if kind == "array":
        return 9, struct.pack("<IQI", 4, 1, number)
    return draw(st.integers(13, 2**32 - 1)), struct.pack("<I", number)


@st.composite
def gguf_rewrites(draw, kind: str):
    """A file re-serialized with one or more parts replaced, framing kept
    consistent (name lengths, dimension counts, padding)."""
    layout = GGUF_LAYOUTS[kind]
    kvs = list(layout.kvs)
    infos = [dict(info, name=info["name"].encode()) for info in layout.infos]
    counts = [None, None]
    padding = "aligned"
    alignment = layout.alignment
    data_len = len(layout.data)
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["name", "dims", "dims", "type", "offset", "resize",
                                     "resize", "reorder", "alignment", "alignment", "key",
                                     "counts", "padding", "drop"]))
        index = draw(st.integers(0, len(infos) - 1))
        info = infos[index]
        if what == "name":
            info["name"] = draw(st.one_of(st.sampled_from(NAMES), st.binary(max_size=12)))
        elif what == "dims":
            info["dims"] = draw(st.lists(_dims(), max_size=6))
        elif what == "type":
            info["type"] = draw(_types())
        elif what == "offset":
            info["offset"] = draw(_offsets(layout, index % len(layout.infos)))
        elif what == "resize":  # a consistent type and shape: often a valid file
            qtype = Q(draw(st.sampled_from(TYPES_DECODED)))
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            if draw(st.integers(0, 3)):
                cols = block * draw(st.integers(0, 4))
                row = cols // block * size
                rows = draw(st.integers(0, data_len // row if row else 4))
            else:  # no rows, of any width: no data at all
                cols = block * draw(st.sampled_from([2**k for k in range(40, 64)]))
                rows = 0
            info.update(type=int(qtype), dims=[cols, rows],
                        offset=layout.alignment * draw(st.integers(0, 3)))
        elif what == "reorder":
            infos = draw(st.permutations(infos))
        elif what == "alignment":  # set, retype or add the alignment key
            key_type, value = draw(gguf_value())
            kvs = [kv for kv in kvs if kv[0] != b"general.alignment"]
            kvs.insert(draw(st.integers(0, len(kvs))), (b"general.alignment", key_type, value))
            if key_type == 4 and (n := struct.unpack("<I", value)[0]) and not n & (n - 1):
                alignment = n
        elif what == "key":  # a key renamed: duplicate, reserved, empty, not UTF-8
            at = draw(st.integers(0, len(kvs) - 1))
            kvs[at] = (draw(st.sampled_from(KEYS)), *kvs[at][1:])
        elif what == "counts":
            counts[draw(st.integers(0, 1))] = draw(_u64s(len(infos) + 1, len(kvs) + 1))
        elif what == "padding":
            padding = draw(st.sampled_from(["none", "extra"]))
        elif what == "drop" and len(infos) > 1:
            infos.pop(index)
    return _serialize(layout.version, kvs, infos, layout.data, alignment, counts=tuple(counts),
                      padding=padding)


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(GGUF_BASES)))
def test_gguf_rewritten_headers(data, kind):
    _check_gguf(data.draw(gguf_rewrites(kind)), kind)


# ---------------------------------------------------------------- bytes and cuts


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(GGUF_BASES)))
def test_gguf_corrupt_region_bytes(data, kind):
    """Bytes flipped or overwritten inside a region chosen by name."""
    raw = bytearray(GGUF_BASES[kind])
    regions = {name: span for name, span in GGUF_LAYOUTS[kind].regions().items()
               if span[1] > span[0]}
    for _ in range(data.draw(st.integers(1, 4))):
        begin, end = regions[data.draw(st.sampled_from(sorted(regions)))]
        at = data.draw(st.integers(begin, end - 1))
        how = data.draw(st.sampled_from(["xor", "set"]))
        value = data.draw(st.sampled_from([1 << k for k in range(8)] + [0xFF]) if how == "xor"
                          else st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF]))
        raw[at] = raw[at] ^ value if how == "xor" else value
    _check_gguf(bytes(raw), kind)


def _gguf_cuts(kind: str) -> list[int]:
    raw = GGUF_BASES[kind]
    cuts = set()
    for begin, end in GGUF_LAYOUTS[kind].regions().values():
        cuts.update(c for b in (begin, end) for c in (b - 1, b, b + 1))
    return sorted(c for c in cuts if 0 <= c <= len(raw))


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(GGUF_BASES)))
def test_gguf_truncated(data, kind):
    raw = GGUF_BASES[kind]
    regions = list(GGUF_LAYOUTS[kind].regions().values())
    inside = st.sampled_from(regions).flatmap(lambda span: st.integers(*span))
    cut = data.draw(st.one_of(st.sampled_from(_gguf_cuts(kind)), inside))
    _check_gguf(raw[:cut], kind)


def test_gguf_every_region_boundary_cut():
    """Not random: both files cut one byte before, at and after every region
    boundary (magic, version, counts, each key-value's parts, each tensor
    info's parts, the padding, each tensor's data, the end)."""
    for kind, raw in GGUF_BASES.items():
        for cut in _gguf_cuts(kind):
            _check_gguf(raw[:cut], kind)


# ---------------------------------------------------------------- GGUF by hand


def _gguf_fields(kind: str, **values) -> bytes:
    """The base file with fields (labels of GGUF_TARGETS, dots as __)
    overwritten in place."""
    raw = bytearray(GGUF_BASES[kind])
    spans = {label: span for label, span, _, _ in GGUF_TARGETS[kind]}
    for label, value in values.items():
        span = spans[label.replace("__", ".")]
        _put(raw, span, value % 2 ** (8 * span[1]))
    return bytes(raw)


def _gguf_tensors(kind: str, changes: dict[str, dict]) -> bytes:
    """The base file re-serialized with tensor infos changed: ``{name:
    {field: value}}``."""
    layout = GGUF_LAYOUTS[kind]
    assert set(changes) <= {info["name"] for info in layout.infos}
    infos = [{**info, "name": info["name"].encode(), **changes.get(info["name"], {})}
             for info in layout.infos]
    return _serialize(layout.version, layout.kvs, infos, layout.data, layout.alignment)


def _gguf_tensor(kind: str, tensor: str, **changes) -> bytes:
    """The base file re-serialized with one tensor info changed."""
    return _gguf_tensors(kind, {tensor: changes})


def _big_endian_file() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.gguf"
        writer = gguf.GGUFWriter(str(path), "test", endianess=gguf.GGUFEndian.BIG)
        writer.add_tensor("t", np.arange(64, dtype=np.float32).reshape(8, 8))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes()


PLAIN, ALIGNED = GGUF_LAYOUTS["plain"], GGUF_LAYOUTS["aligned"]


def _nested_arrays_file(depth: int = 5000) -> bytes:
    """The plain file with one more key: an array of an array of ... (depth
    levels) of no numbers.  Skipping it recursed past Python's limit."""
    array, number = int(gguf.GGUFValueType.ARRAY), int(gguf.GGUFValueType.UINT32)
    value = struct.pack("<IQ", array, 1) * depth + struct.pack("<IQ", number, 0)
    infos = [dict(info, name=info["name"].encode()) for info in PLAIN.infos]
    return _serialize(PLAIN.version, [*PLAIN.kvs, (b"test.nested", array, value)], infos,
                      PLAIN.data, PLAIN.alignment)


# (file, tensor to open, what the message must say besides the path)
GGUF_BAD = {
    # Found by test_gguf_corrupt_fields and test_gguf_rewritten_headers: the
    # reader adds the data offset to the data section's start in uint64, so an
    # offset near 2**64 wrapped around to the header, and the table opened
    # serving the header's bytes as rows.
    "offset 2**64-1 wraps to the padding": (
        _gguf_fields("plain", t__offset=U64 - 1), "t", "tensor 't'"),
    "offset wraps to byte 0": (
        _gguf_fields("plain", t__offset=U64 - PLAIN.data_offset), "t", "tensor 't'"),
    "offset wraps, general.alignment set": (
        _gguf_fields("aligned", t__offset=U64 - 1), "t", "tensor 't'"),
    "offset wraps onto the tensor infos": (
        _gguf_fields("aligned", t__offset=U64 - ALIGNED.data_offset + ALIGNED.infos_start),
        "t", "tensor 't'"),
    # Rows of 2**57 x 34 bytes, no rows: the safetensors path refuses rows
    # wider than MAX_ROW_BYTES, from_gguf took them (a bad id then failed
    # allocating its row, not with IndexError).
    "no rows of 2**62 Q8_0 values": (
        _gguf_tensor("plain", "f", type=int(Q.Q8_0), dims=[2**62, 0]), "f", "tensor 'f'"),
    # Errors that were ValueErrors naming the file, but with the reader's
    # words (numpy's reshape and view errors), not the tensor's.
    "no rows of 2**62 F32 values": (
        _gguf_tensor("plain", "f", dims=[2**62, 0]), "f", "tensor 'f'"),
    "dims product past int64": (
        _gguf_fields("plain", t__dim0=2**32, t__dim1=2**32), "t", "tensor 't'"),
    "a dim negative as int64": (_gguf_fields("plain", t__dim1=2**63), "t", "tensor 't'"),
    "n_dims 2**32-1": (_gguf_fields("plain", t__n_dims=2**32 - 1), "t", "tensor 't'"),
    "five dims": (_gguf_tensor("plain", "f", dims=[8, 3, 1, 1, 1]), "f", "tensor 'f'"),
    "unknown type in another tensor": (_gguf_fields("plain", f__type=99), "t", "tensor 'f'"),
    "row not whole blocks in another tensor": (
        _gguf_fields("aligned", f__type=int(Q.Q8_0)), "t", "tensor 'f'"),
    "name not UTF-8": (_gguf_fields("plain", t__name=0xFF), "t", "not UTF-8"),
    "duplicate tensor name": (_gguf_tensor("plain", "f", name=b"t"), "t", "tensor 't'"),
    "alignment 48": (_gguf_fields("aligned", alignment=48), "t", "general.alignment"),
    "alignment of type UINT64": (
        _gguf_fields("aligned", general__alignment__type=10), "t", "general.alignment"),
    # Stricter than the reader, as llama.cpp is: offsets are multiples of the
    # alignment.
    "misaligned offset": (
        _gguf_fields("plain", t__offset=PLAIN.infos[0]["offset"] + 1), "t", "tensor 't'"),
    # A big-endian file: the reader reads it, but its rows are big-endian.
    "big-endian file": (_big_endian_file(), "t", "big-endian"),
    "arrays nested 5000 deep": (_nested_arrays_file(), "t", "nested too deep"),
}


@pytest.mark.parametrize("case", sorted(GGUF_BAD))
def test_gguf_regressions(tmp_path, case):
    raw, tensor, says = GGUF_BAD[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw)
    with _hang_guard():
        with pytest.raises(ValueError) as info:
            ple.Table.from_gguf(path, tensor)
    assert str(path) in str(info.value) and says in str(info.value), str(info.value)
    _check_gguf(raw, "plain", names=[tensor])  # and the fuzz check agrees


# (tensor infos changed, the two tensors and their spans in the data section
# that the error names; PLAIN_SPANS says where the tensors were).  The gguf
# reader reads each of these files; ple refuses them, as ggml's loader does and
# as ple refuses such a safetensors file.
GGUF_SHARED_BYTES = {
    "two tensors at one offset": ({"t": {"type": int(Q.F32), "dims": [8, 3], "offset": 352}},
                                  ("f", 352, 448), ("t", 352, 448)),
    "a tensor that starts inside another": ({"f": {"offset": 320}},
                                            ("t", 0, 340), ("f", 320, 416)),
    "a tensor inside another": ({"v": {"offset": 32}}, ("t", 0, 340), ("v", 32, 52)),
}


@pytest.mark.parametrize("case", sorted(GGUF_SHARED_BYTES))
def test_gguf_tensors_that_share_bytes_are_refused(tmp_path, case):
    changes, first, second = GGUF_SHARED_BYTES[case]
    path = tmp_path / "shared.gguf"
    path.write_bytes(_gguf_tensors("plain", changes))
    assert [t.name for t in GGUFReader(path).tensors] == ["t", "f", "v", "h"]
    start = PLAIN.data_offset
    (a, a_begin, a_end), (b, b_begin, b_end) = first, second
    expected = (f"{path}: corrupt GGUF header: tensors {a!r} (bytes {start + a_begin} to "
                f"{start + a_end}) and {b!r} (bytes {start + b_begin} to {start + b_end}) "
                "share bytes")
    # Whichever tensor is asked for, h too, which shares no byte: the file is corrupt.
    for tensor in ("t", "f", "h"):
        with pytest.raises(ValueError) as info:
            ple.Table.from_gguf(path, tensor)
        assert str(info.value) == expected


def test_gguf_tensors_that_touch_or_hold_no_bytes_open():
    """f moved to end where h begins, and v emptied to no values inside t's
    bytes: no byte is read as two tensors', and every table opens."""
    raw = _gguf_tensors("plain", {"f": {"offset": 384}, "v": {"dims": [0], "offset": 32}})
    _check_gguf(raw, "plain", must_open=True)
