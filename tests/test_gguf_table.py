"""GGUF tables: every format ple decodes, gathered rows equal to
gguf.quants.dequantize of the same rows, and every bad file."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import ple
from ple.formats import BLOCK_FORMATS, BY_GGUF_TYPE

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from helpers import random_gguf_blocks, write_gguf  # noqa: E402
from ple.gguf_header import read_gguf_header  # noqa: E402

ROWS, COLS = 37, 512  # 2 blocks of 256 per row for the K-quants
rng = np.random.default_rng(0)


# The formats gguf.quants.quantize writes; the tables of the other block
# formats are random blocks with finite f16 scales.
QUANTIZED = {"BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ1_0", "TQ2_0", "MXFP4"}
FORMATS = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16,
           **{name.upper(): Q[name.upper()] for name in BLOCK_FORMATS}}


def table_bytes(name: str, values: np.ndarray) -> np.ndarray:
    if name in QUANTIZED:
        return gguf.quants.quantize(values, Q[name])
    rows, cols = values.shape
    blocks = rows * cols // BLOCK_FORMATS[name.lower()].block_size
    return random_gguf_blocks(name.lower(), blocks, rng).reshape(rows, -1)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    values = rng.uniform(-3, 3, (ROWS, COLS)).astype(np.float32)
    tensors = {}
    for name, qtype in FORMATS.items():
        if qtype == Q.F32:
            tensors[name] = (values, qtype)
        elif qtype == Q.F16:
            tensors[name] = (values.astype(np.float16), qtype)
        else:
            tensors[name] = (table_bytes(name, values), qtype)
    tensors["vector"] = (np.ones(8, np.float32), Q.F32)
    # A type gguf has no dequantize of (Q8_1: what ggml multiplies Q8_0 by).
    q8_1_bytes = COLS // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]
    tensors["Q8_1"] = (rng.integers(0, 256, (ROWS, q8_1_bytes), dtype=np.uint8), Q.Q8_1)
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    write_gguf(path, tensors)
    return path, tensors


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_gguf_dequantize(gguf_file, name, dtype):
    path, tensors = gguf_file
    data, qtype = tensors[name]
    expected = gguf.quants.dequantize(data, qtype)
    ids = torch.from_numpy(rng.integers(0, ROWS, (4, 25)))
    ids[0, :2] = torch.tensor([0, ROWS - 1])
    with ple.Table.from_gguf(path, name) as table:
        assert (table.num_rows, table.cols) == (ROWS, COLS)
        assert table.format == name.lower()
        got = torch.ops.ple.disk_gather(ids, table.handle, dtype)
    want = torch.from_numpy(np.ascontiguousarray(expected[ids.numpy()])).to(dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_block_rows_stay_packed(gguf_file):
    path, tensors = gguf_file
    with ple.Table.from_gguf(path, "Q4_K") as table:
        assert table.row_bytes == COLS // 256 * 144
        raw = torch.ops.ple.disk_gather_bytes(torch.tensor([5]), table.handle)
    assert np.array_equal(raw.numpy()[0], tensors["Q4_K"][0][5])


@pytest.mark.parametrize("name", sorted(BY_GGUF_TYPE))
def test_formats_have_ggufs_block_sizes(name):
    """from_gguf relies on the header walk, which checks rows and data sizes
    with gguf's block sizes, and then reads rows with ple's."""
    fmt, qtype = BY_GGUF_TYPE[name], Q[name]
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    assert fmt.row_bytes(block_size) == block_bytes
    assert fmt.gguf_type in (None, int(qtype))
    assert not fmt.is_block or (fmt.block_size, fmt.gguf_type) == (block_size, int(qtype))


def test_the_docs_list_every_block_format_and_its_decoders():
    """docs/tables.md's table of block types: each of BLOCK_FORMATS, its
    sizes, bits per value and the Triton kernel that decodes it."""
    pytest.importorskip("triton")
    from ple.kernels import decode_gguf_iq_triton, decode_gguf_k_triton, decode_gguf_triton

    kernels = {"decode_gguf_triton": decode_gguf_triton.FORMAT_NAMES,
               "decode_gguf_k_triton": decode_gguf_k_triton.K_FORMAT_NAMES,
               "decode_gguf_iq_triton": decode_gguf_iq_triton.IQ_FORMAT_NAMES}
    text = (Path(__file__).resolve().parents[1] / "docs" / "tables.md").read_text()
    rows = re.findall(r"^\| (\w+) \| `(\w+)` \| (\d+) \| (\d+) \| ([\d.]+) \| "
                      r"`gguf.quants.dequantize` \| `(\w+)\.py` \|$", text, re.M)
    listed = {fmt: (name, int(size), int(nbytes), float(bits), kernel)
              for name, fmt, size, nbytes, bits, kernel in rows}
    assert listed == {
        fmt.name: (fmt.name.upper(), fmt.block_size, fmt.block_bytes,
                   fmt.block_bytes * 8 / fmt.block_size,
                   next(k for k, names in kernels.items() if fmt.name in names))
        for fmt in BLOCK_FORMATS.values()}


def test_not_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ValueError, match=rf"{path}: not a readable GGUF file"):
        ple.Table.from_gguf(path, "t")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        ple.Table.from_gguf(tmp_path / "none.gguf", "t")


def test_unknown_tensor_lists_the_candidates(gguf_file):
    path, _ = gguf_file
    with pytest.raises(ValueError, match=rf"{path}: no tensor named 'nope'; 2-D tensors: .*'Q8_0'"):
        ple.Table.from_gguf(path, "nope")


def test_quant_type_not_decoded_is_named(gguf_file):
    path, _ = gguf_file
    with pytest.raises(ValueError,
                       match=rf"{path}: tensor 'Q8_1' is Q8_1, which ple does not decode"):
        ple.Table.from_gguf(path, "Q8_1")


def test_not_2d(gguf_file):
    path, _ = gguf_file
    with pytest.raises(ValueError, match=rf"{path}: tensor 'vector' is not 2-D"):
        ple.Table.from_gguf(path, "vector")


def test_row_width_not_whole_blocks(tmp_path):
    path = tmp_path / "odd.gguf"
    data = gguf.quants.quantize(np.ones((4, 64), np.float32), Q.Q8_0)  # 2 blocks per row
    write_gguf(path, {"odd": (data, Q.Q8_0)})
    # Patch the tensor's dimensions (ne0 = 64, ne1 = 4, after the name and the
    # u32 dimension count) to 2 rows of 128 + 16 values: the same bytes, but a
    # row that is not a whole number of 32-value blocks.
    raw = bytearray(path.read_bytes())
    dims = raw.index(b"odd") + 3 + 4
    assert int.from_bytes(raw[dims:dims + 8], "little") == 64
    raw[dims:dims + 16] = (144).to_bytes(8, "little") + (2).to_bytes(8, "little")
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=rf"{path}.*a row of 144 values is not a whole number of "
                                         rf"Q8_0 blocks of 32"):
        ple.Table.from_gguf(path, "odd")


def test_data_past_the_end_of_the_file(gguf_file, tmp_path):
    path, _ = gguf_file
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[: os.path.getsize(path) - 1000])
    with pytest.raises(ValueError, match=rf"{short}.*runs past the end of the file"):
        ple.Table.from_gguf(short, "Q6_K")


def test_a_count_larger_than_the_file_is_rejected_at_once(gguf_file, tmp_path):
    path, _ = gguf_file
    raw = bytearray(path.read_bytes())
    raw[23] = 0xA3  # the high byte of the key-value count
    bad = tmp_path / "count.gguf"
    bad.write_bytes(raw)
    with pytest.raises(ValueError, match=rf"{bad}: not a readable GGUF file: .* cannot fit"):
        ple.Table.from_gguf(bad, "Q8_0")


def test_an_array_count_larger_than_the_file_is_rejected_at_once(tmp_path):
    path = tmp_path / "array.gguf"
    writer = gguf.GGUFWriter(str(path), "test")
    writer.add_array("numbers", [1, 2, 3])
    writer.add_tensor("t", np.ones((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    raw = bytearray(path.read_bytes())
    count = raw.index(b"numbers") + len(b"numbers") + 4 + 4  # after the value and item types
    assert int.from_bytes(raw[count:count + 8], "little") == 3
    raw[count + 7] = 0x40
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=rf"{path}: not a readable GGUF file: an array of \d+ items"):
        ple.Table.from_gguf(path, "t")


def test_corrupt_headers_raise_or_open_never_hang(gguf_file, tmp_path):
    """Random byte flips and cuts in the header region: each open raises
    ValueError or OSError naming the file, or opens a table that gathers."""
    import random
    import signal

    good = gguf_file[0].read_bytes()
    header_end = good.index(b"Q6_K") + 64
    rnd = random.Random(1)
    path = tmp_path / "case.gguf"

    def too_slow(*_):
        raise AssertionError("an open took more than 10 s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    try:
        for _ in range(150):
            raw = bytearray(good)
            for _ in range(rnd.randint(1, 4)):
                raw[rnd.randrange(header_end)] = rnd.choice([rnd.randrange(256), 0xFF])
            if rnd.random() < 0.2:
                raw = raw[: rnd.randrange(len(raw))]
            path.write_bytes(raw)
            signal.alarm(10)
            try:
                with ple.Table.from_gguf(path, "Q8_0") as table:
                    torch.ops.ple.disk_gather(torch.arange(table.num_rows), table.handle)
            except (ValueError, OSError) as error:
                assert str(path) in str(error), repr(error)
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("host_rows", [0, 20])
def test_cuda_rows_equal_the_cpu_rows(gguf_file, name, dtype, host_rows):
    from ple.kernels import decode_gguf_triton
    # The kernel the operator launches is compiled (TRITON_INTERPRET was unset when it loaded).
    assert type(decode_gguf_triton.decode_blocks_kernel).__name__ == "JITFunction"
    path, _ = gguf_file
    ids = torch.from_numpy(rng.integers(0, ROWS, (3, 41)))
    with ple.Table.from_gguf(path, name) as table:
        expected = torch.ops.ple.disk_gather(ids, table.handle, dtype)
        table.place(host_rows=host_rows)
        values = torch.ops.ple.disk_gather(ids.cuda(), table.handle, dtype)
        ints = {4: torch.int32, 2: torch.int16}[values.element_size()]
        assert torch.equal(values.cpu().view(ints), expected.view(ints))


def test_a_table_of_no_rows_of_huge_width_raises_index_error(tmp_path):
    """Every id is out of range of a table of no rows, however wide its rows
    claim to be: IndexError before anything (the output) is allocated."""
    path = tmp_path / "empty.gguf"
    write_gguf(path, {"wide": (np.zeros((0, 2 ** 40), np.float32), Q.F32),
                      "data": (np.ones(8, np.float32), Q.F32)})
    with ple.Table.from_gguf(path, "wide") as table:
        assert table.num_rows == 0
        with pytest.raises(IndexError, match=r"row id 3 at position 0 is out of range \[0, 0\)"):
            table.gather_bytes(torch.tensor([3]))
        assert table.gather_bytes(torch.tensor([], dtype=torch.int64)).shape == (0, table.row_bytes)


def test_header_values_equal_the_gguf_readers(tmp_path):
    path = tmp_path / "kv.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen4exp")
    writer.add_uint32("a.u32", 7)
    writer.add_int64("a.i64", -5)
    writer.add_array("a.ints", [3, -1, 2**31 - 1])
    writer.add_string("a.text", "not an integer")
    writer.add_tensor("t", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_gguf_header(path, keys=("a.u32", "a.i64", "a.ints", "a.missing"))
    fields = gguf.GGUFReader(path).fields
    assert header.values == {key: fields[key].contents() for key in ("a.u32", "a.i64", "a.ints")}
    assert list(header.tensors) == ["t"]
    with pytest.raises(ValueError, match=r"a.text is of value type 8, not an integer"):
        read_gguf_header(path, keys=("a.text",))


@pytest.mark.parametrize("keys", [(), ("general.alignment",), ("general.alignment", "a.u32")])
def test_a_wanted_alignment_is_returned_and_applied(tmp_path, keys):
    """general.alignment asked for among the keys is returned and still sets
    where the tensors are: their offsets equal gguf.GGUFReader's."""
    path = tmp_path / "aligned.gguf"
    writer = gguf.GGUFWriter(str(path), "test")
    writer.add_custom_alignment(128)
    writer.add_uint32("a.u32", 7)
    writer.add_string("a.text", "moves the end of the header")
    writer.add_tensor("v", np.arange(5, dtype=np.float32))  # 20 bytes: the next is padded
    writer.add_tensor("t", np.ones((3, 8), dtype=np.float32))
    writer.add_tensor("h", np.zeros((2, 16), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(path)
    assert reader.alignment == 128
    # The default alignment would start the data elsewhere: this file tells them apart.
    infos_end = max(t.field.offset + sum(int(part.nbytes) for part in t.field.parts)
                    for t in reader.tensors)
    assert infos_end + -infos_end % 32 != reader.data_offset
    header = read_gguf_header(path, keys=keys)
    assert header.values == {key: reader.fields[key].contents() for key in keys}
    if "general.alignment" in keys:
        assert header.values["general.alignment"] == 128
    assert {name: (e.offset, e.nbytes) for name, e in header.tensors.items()} == {
        t.name: (int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
    assert all(e.offset % 128 == 0 for e in header.tensors.values())


def test_a_wanted_alignment_is_still_checked(tmp_path):
    path = tmp_path / "bad_alignment.gguf"
    writer = gguf.GGUFWriter(str(path), "test")
    writer.add_uint32("general.alignment", 48)  # add_custom_alignment refuses it
    writer.add_tensor("v", np.arange(5, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for keys in ((), ("general.alignment",)):
        with pytest.raises(ValueError, match=r"general.alignment 48 is not a power of two"):
            read_gguf_header(path, keys=keys)
