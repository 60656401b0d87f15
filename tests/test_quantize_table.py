"""ple-quantize-table (tools/quantize_table.py) and ple's K-quant quantizers
(ple/kquants.py).

* The quantizers: every value within its bound of the input (half its
  sub-block's step, plus one step of the block's minimum scale for Q4_K and
  Q5_K), a root-mean-square error well below the step, and bytes that gguf
  reads back: ``gguf.quants.dequantize`` of them equals ple's decode of them,
  on CPU and through the Triton decoder (interpreted), bit for bit.
* The tool: for every type it writes, a checkpoint's table (one file, a
  sharded checkpoint with an index, a shard family of FP8 rows with a scale)
  becomes one GGUF tensor whose bytes are gguf's quantization of the table's
  float32 values (ple's for the K-quants), which ``Table.from_gguf`` opens
  under llama.cpp's name and gathers equal to gguf's dequantize; its
  metadata names the source.  It reads a chunk of rows at a time; it refuses
  what cannot make a file with argparse's usage error before writing
  anything; and a failure part way leaves no file behind.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple
from helpers import assert_same_bits, load_interpreted
from ple.formats import BLOCK_FORMATS
from ple.kquants import quantize_k

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from ple_tools import quantize_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TABLE = "model.language_model.embed_tokens_per_layer.weight"
ROWS, COLS = 300, 3 * 256  # a per-layer table of 3 layers of 256 values
K_TYPES = ("q4_k", "q5_k", "q6_k")


def weights(rows: int = ROWS, cols: int = COLS, seed: int = 0, scale: float = 0.03) -> np.ndarray:
    """Normal float32 weights with the sub-blocks that test the edges: all
    zero, constant positive, constant negative, one large value."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * scale
    values[0, :32] = 0
    values[1, :32] = scale
    values[2, :32] = -scale
    values[3, 5] = 40 * scale
    return values


# --- the quantizers -------------------------------------------------------------

def error_bound(values: np.ndarray, name: str) -> np.ndarray:
    """Each value's bound, from the input alone: half its sub-block's step
    (the range it spans over its quants, or a block scale's unit more, since
    the sub-block scales are rounded up) and, with a minimum, one unit of the
    block's minimum scale; units a 1/1000 larger for the f16 roundings, and
    2^-24 (the f16 subnormal) each."""
    sub, levels, top = (16, 127, 31) if name == "q6_k" else (32, 63, (1 << int(name[1])) - 1)
    blocks = values.reshape(-1, 256 // sub, sub)
    if name == "q6_k":
        step = np.abs(blocks).max(axis=2) / top
        dmin = np.zeros_like(step[:, :1])
    else:
        low = np.minimum(blocks.min(axis=2), 0)
        step = (blocks.max(axis=2) - low) / top
        dmin = (-low).max(axis=1, keepdims=True) / levels * 1.001 + 2**-24
    unit = step.max(axis=1, keepdims=True) / levels * 1.001 + 2**-24
    bound = (step + unit) / 2 + dmin
    return np.repeat(bound, sub, axis=1).reshape(values.shape) * 1.0001


@pytest.mark.parametrize("scale", [0.03, 1.0, 1e-6, 500.0])
@pytest.mark.parametrize("name", K_TYPES)
def test_k_quantizers_round_trip_within_their_bound(name, scale):
    values = weights(64, 512, seed=1, scale=scale)
    packed = quantize_k(values, name)
    assert packed.dtype == np.uint8 and packed.shape == (64, 2 * BLOCK_FORMATS[name].block_bytes)
    back = gguf.quants.dequantize(packed, Q[name.upper()])
    error = np.abs(back - values)
    assert (error <= error_bound(values, name)).all()
    assert (back[0, :32] == 0).all()  # a sub-block of zeros stays zeros
    # Nearest quants: the root-mean-square error is about a step over sqrt(12).
    step = {"q4_k": 15, "q5_k": 31, "q6_k": 31}[name]
    assert np.sqrt((error ** 2).mean()) < 8 * scale / step / np.sqrt(12)


def test_k_quantizers_refuse_what_they_cannot_write():
    with pytest.raises(ValueError, match="ple's quantizers write q4_k, q5_k, q6_k, not 'q8_0'"):
        quantize_k(np.zeros((1, 256), np.float32), "q8_0")
    with pytest.raises(ValueError, match="rows of 300 values are not whole q5_k blocks of 256"):
        quantize_k(np.zeros((1, 300), np.float32), "q5_k")


@pytest.mark.parametrize("name", K_TYPES)
def test_k_quantized_bytes_decode_as_gguf_decodes_them(name, tmp_path):
    """ple's decode of the bytes (CPU, and the Triton decoder under the
    interpreter) equals gguf's dequantize, to the bit."""
    fmt = BLOCK_FORMATS[name]
    packed = quantize_k(weights(8, 512, seed=2), name)
    want = torch.from_numpy(gguf.quants.dequantize(packed, Q[name.upper()]))
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "test")
    writer.add_tensor("t", packed, raw_dtype=Q[name.upper()])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with ple.Table.from_gguf(path, "t") as table:
        assert_same_bits(ple.gather(table, torch.arange(8), torch.float32), want)
    triton = load_interpreted(REPO / "kernels" / "decode_gguf_triton.py")
    out = torch.empty(8, 512)
    triton.decode_blocks_triton(torch.from_numpy(packed), fmt, 1.0, out)
    assert_same_bits(out, want)


# --- the tool ----------------------------------------------------------------------

def run_tool(*arguments) -> subprocess.CompletedProcess:
    """The console script, as a user runs it."""
    command = shutil.which("ple-quantize-table", path=str(Path(sys.executable).parent))
    assert command is not None, "ple-quantize-table is not installed next to this Python"
    return subprocess.run([command, *map(str, arguments)], capture_output=True, text=True,
                          timeout=300)


def call_tool(*arguments) -> int:
    """The tool's main in this process (to patch it): its exit status."""
    try:
        return quantize_table.main([str(a) for a in arguments])
    except SystemExit as exit:
        return exit.code


def gguf_tensor(path: Path, name: str):
    """The tensor ``name`` of a GGUF file, by gguf's reader."""
    reader = gguf.GGUFReader(path)
    return reader, next(t for t in reader.tensors if t.name == name)


def expected_bytes(values: np.ndarray, name: str) -> np.ndarray:
    if name in K_TYPES:
        return quantize_k(values, name)
    return np.ascontiguousarray(gguf.quants.quantize(values, Q[name.upper()])).view(np.uint8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """A checkpoint directory (model.safetensors) with a BF16 per-layer table
    named as the published Gemma 4 checkpoints name it, and another tensor."""
    directory = tmp_path_factory.mktemp("checkpoint")
    table = torch.from_numpy(weights()).to(torch.bfloat16)
    save_file({TABLE: table, "model.language_model.norm.weight": torch.ones(8)},
              str(directory / "model.safetensors"))
    return directory, table.float().numpy()


@pytest.mark.parametrize("name", quantize_table.TYPES)
def test_each_type_is_ggufs_quantization_and_opens_as_the_table(checkpoint, name, tmp_path):
    directory, values = checkpoint
    out = tmp_path / "table.gguf"
    # Chunks of 11 rows: the last one short.
    assert call_tool(directory, out, "--type", name, "--chunk-mib", 11 * COLS * 4 / 2**20) == 0
    reader, tensor = gguf_tensor(out, "per_layer_token_embd.weight")
    qtype = Q[name.upper()]
    assert tensor.tensor_type == qtype
    assert list(tensor.shape) == [COLS, ROWS]  # GGUF's order: the row length first
    written = np.asarray(tensor.data).view(np.uint8).reshape(ROWS, -1)
    assert np.array_equal(written, expected_bytes(values, name))
    assert reader.fields["ple.source.tensor"].contents() == TABLE
    assert reader.fields["ple.source.shape"].contents() == [ROWS, COLS]
    assert reader.fields["ple.source.dtype"].contents() == "bf16"
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, ROWS, 50))
    with ple.Table.from_gguf(out, "per_layer_token_embd.weight") as table:
        assert (table.num_rows, table.cols, table.format) == (ROWS, COLS, name)
        got = ple.gather(table, ids, torch.float32)
    want = torch.from_numpy(gguf.quants.dequantize(written, qtype)[ids.numpy()])
    assert_same_bits(got, want)
    if name in ("f32", "bf16"):
        assert np.array_equal(want.numpy(), values[ids.numpy()])  # bf16 values, kept exactly


def test_a_sharded_checkpoint_and_the_text_layout(tmp_path):
    """Gemma 3n's text layout (model.embed_tokens_per_layer.weight) in the
    second of two files an index names, found by the default name."""
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    values = weights(40, 512, seed=4)
    files = {"model-00001-of-00002.safetensors": {"model.embed_tokens.weight": torch.zeros(4, 8)},
             "model-00002-of-00002.safetensors": {
                 "model.embed_tokens_per_layer.weight": torch.from_numpy(values)}}
    for file, tensors in files.items():
        save_file(tensors, str(directory / file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: file for file, tensors in files.items() for name in tensors}}))
    out = tmp_path / "out.gguf"
    run = run_tool(directory, out, "--type", "q6_k")
    assert run.returncode == 0, run.stderr
    assert "quantizing 'model.embed_tokens_per_layer.weight' (40 x 512 f32) to q6_k" in run.stderr
    assert f"wrote {out}" in run.stderr
    _, tensor = gguf_tensor(out, "per_layer_token_embd.weight")
    assert np.array_equal(np.asarray(tensor.data).reshape(40, -1), quantize_k(values, "q6_k"))


def test_a_shard_family_of_scaled_fp8_rows(tmp_path):
    """Any table ple opens: FP8 shards with a scale, quantized from their
    values times the scale, under the name given."""
    raw = torch.randint(0, 0x7E, (2, 20, 64), dtype=torch.uint8)  # finite FP8 patterns
    tensors = {f"t.shard_{i}.weight": raw[i].view(torch.float8_e4m3fn) for i in range(2)}
    save_file({**tensors, "t.weight_scale": torch.tensor(0.25)}, str(tmp_path / "fp8.safetensors"))
    out = tmp_path / "out.gguf"
    assert call_tool(tmp_path / "fp8.safetensors", out, "--tensor", "t", "--type", "q8_0",
                     "--name", "table") == 0
    values = raw.view(torch.float8_e4m3fn).float().reshape(40, 64).numpy() * np.float32(0.25)
    _, tensor = gguf_tensor(out, "table")
    assert np.array_equal(np.asarray(tensor.data).reshape(40, -1),
                          gguf.quants.quantize(values, Q.Q8_0))


def test_rows_are_read_a_chunk_at_a_time(checkpoint, tmp_path, monkeypatch):
    """The float32 values quantized at a time are at most --chunk-mib of them."""
    directory, _ = checkpoint
    seen = []
    quantize_rows = quantize_table.quantize_rows

    def recording(values, qtype):
        seen.append(values.nbytes)
        return quantize_rows(values, qtype)

    monkeypatch.setattr(quantize_table, "quantize_rows", recording)
    chunk = 16 * COLS * 4
    assert call_tool(directory, tmp_path / "t.gguf", "--chunk-mib", chunk / 2**20,
                     "--jobs", 1) == 0  # one process: this one, which records
    assert max(seen) == chunk and sum(seen) == ROWS * COLS * 4 and len(seen) == -(-ROWS // 16)


def test_a_failure_part_way_leaves_no_file(checkpoint, tmp_path, monkeypatch):
    directory, _ = checkpoint
    calls = []
    quantize_rows = quantize_table.quantize_rows

    def interrupted(values, qtype):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return quantize_rows(values, qtype)

    monkeypatch.setattr(quantize_table, "quantize_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        call_tool(directory, tmp_path / "t.gguf", "--chunk-mib", 0.01, "--jobs", 1)
    assert list(tmp_path.iterdir()) == []


def test_processes_write_the_bytes_one_process_writes(checkpoint, tmp_path):
    directory, _ = checkpoint
    for jobs in (1, 3):
        assert call_tool(directory, tmp_path / f"t{jobs}.gguf", "--type", "q5_k",
                         "--chunk-mib", 0.01, "--jobs", jobs) == 0
    assert (tmp_path / "t1.gguf").read_bytes() == (tmp_path / "t3.gguf").read_bytes()


def test_a_value_that_is_not_finite_is_named_and_nothing_is_written(tmp_path, capsys):
    values = weights(30, 256)
    values[17, 9] = np.inf
    save_file({TABLE: torch.from_numpy(values)}, str(tmp_path / "model.safetensors"))
    out = tmp_path / "out" / "t.gguf"
    out.parent.mkdir()
    assert call_tool(tmp_path, out, "--type", "q4_k", "--chunk-mib", 0.005) == 1
    assert (f"ple-quantize-table: error: {tmp_path / 'model.safetensors'}: row 17 of {TABLE!r} "
            "holds a value that is not finite, which q4_k cannot hold") in capsys.readouterr().err
    assert list(out.parent.iterdir()) == []
    assert call_tool(tmp_path, out, "--type", "f16") == 0  # F16 keeps it


@pytest.mark.parametrize("arguments, line", [
    (["--type", "q3_k"], "argument --type: invalid choice: 'q3_k' (choose from "),
    (["--type", "q5_k", "--tensor", "model.language_model.norm.weight"],
     "argument checkpoint: "),
    (["--tensor", "nope"], "argument checkpoint: "),
    (["--chunk-mib", "0"], "argument --chunk-mib: expected a number above 0, got '0'"),
])
def test_refusals_before_writing(checkpoint, tmp_path, arguments, line):
    directory, _ = checkpoint
    run = run_tool(directory, tmp_path / "t.gguf", *arguments)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("usage: ple-quantize-table ")
    assert run.stderr.splitlines()[-1].startswith(f"ple-quantize-table: error: {line}")
    assert list(tmp_path.iterdir()) == []


def test_rows_that_are_not_whole_blocks_are_refused(tmp_path):
    save_file({TABLE: torch.zeros(4, 96)}, str(tmp_path / "model.safetensors"))
    run = run_tool(tmp_path, tmp_path / "t.gguf", "--type", "q5_k")
    assert run.returncode == 2
    assert run.stderr.splitlines()[-1] == (
        f"ple-quantize-table: error: argument --type: q5_k packs 256 values per block, and the "
        f"rows of {TABLE!r} have 96 values")
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_an_existing_output_is_replaced_only_when_asked(checkpoint, tmp_path):
    directory, _ = checkpoint
    out = tmp_path / "t.gguf"
    out.write_bytes(b"a file of the user's")
    run = run_tool(directory, out, "--type", "q8_0")
    assert run.returncode == 2
    assert run.stderr.splitlines()[-1] == (
        f"ple-quantize-table: error: argument output: {out} exists (--force replaces it)")
    assert out.read_bytes() == b"a file of the user's"
    assert run_tool(directory, out, "--type", "q8_0", "--force").returncode == 0
    assert gguf_tensor(out, "per_layer_token_embd.weight")[1].tensor_type == Q.Q8_0


def test_the_checkpoint_itself_is_never_the_output(checkpoint, tmp_path):
    directory, _ = checkpoint
    source = directory / "model.safetensors"
    before = source.read_bytes()
    run = run_tool(directory, source, "--force")
    assert run.returncode == 2
    assert run.stderr.splitlines()[-1] == (
        f"ple-quantize-table: error: argument output: {source} holds the table itself")
    assert source.read_bytes() == before
