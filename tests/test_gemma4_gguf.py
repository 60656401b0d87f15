"""A Gemma 4 GGUF as llama.cpp's converter writes it: the per-layer table is
``per_layer_token_embd.weight``, of GGUF dimensions [layers x per-layer
hidden, per-layer vocabulary] (the row length first), so a table of
[vocabulary, layers x hidden] rows; the popular files hold it in Q5_K.

Written with gguf's GGUFWriter beside the tensors of such a file, in Q5_K
(random blocks) and other types, it opens with ``Table.from_gguf`` and
serves ``PackedGGUFEmbedding`` and ``DiskEmbedding`` (on CPU, and on CUDA
where there is one) with gguf's dequantize of the rows, and a Gemma layer's
slice of them; its rows stay packed: the bytes gathered per row, on disk and
staged, are the packed row's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ple
from helpers import assert_same_bits, random_gguf_blocks
from ple.formats import BLOCK_FORMATS
from ple.layers import DiskEmbedding, PackedGGUFEmbedding

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

LAYERS, PER_LAYER, VOCAB, HIDDEN = 5, 256, 300, 64
TABLE = "per_layer_token_embd.weight"
# Q5_K first (what the published files hold); random blocks where gguf cannot quantize.
TYPES = ("q5_k", "q4_k", "q6_k", "q8_0", "iq4_xs", "iq2_xs")
rng = np.random.default_rng(0)


def table_rows(name: str) -> np.ndarray:
    """The per-layer table's packed rows, uint8 [VOCAB, row_bytes]."""
    cols = LAYERS * PER_LAYER
    if name == "q8_0":
        values = rng.standard_normal((VOCAB, cols)).astype(np.float32) * 0.05
        return gguf.quants.quantize(values, Q.Q8_0)
    blocks = random_gguf_blocks(name, VOCAB * cols // BLOCK_FORMATS[name].block_size, rng)
    return blocks.reshape(VOCAB, -1)


@pytest.fixture(scope="module", params=TYPES)
def gemma4_gguf(request, tmp_path_factory):
    """A Gemma 4 E2B-shaped GGUF (few layers, small vocabulary): metadata and
    tensors named as convert_hf_to_gguf.py names them, the per-layer table
    between others (so it starts at an offset of its own)."""
    name = request.param
    rows = table_rows(name)
    path = tmp_path_factory.mktemp("gemma4") / f"gemma-4-e2b-{name}.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_embedding_length_per_layer_input(PER_LAYER)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(
        rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.add_tensor(TABLE, rows, raw_dtype=Q[name.upper()])
    writer.add_tensor("per_layer_model_proj.weight",
                      rng.standard_normal((LAYERS * PER_LAYER, HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, name, rows


def reference(rows: np.ndarray, name: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values = gguf.quants.dequantize(rows, Q[name.upper()])
    return torch.from_numpy(np.ascontiguousarray(values[ids.numpy()])).to(dtype)


def test_the_table_has_llama_cpps_name_and_dimensions(gemma4_gguf):
    path, name, rows = gemma4_gguf
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == TABLE)
    assert list(tensor.shape) == [LAYERS * PER_LAYER, VOCAB]  # GGUF's order: the row length first
    with ple.Table.from_gguf(path, TABLE) as table:
        assert (table.num_rows, table.cols, table.format) == (VOCAB, LAYERS * PER_LAYER, name)
        assert table.row_bytes == rows.shape[1] == BLOCK_FORMATS[name].row_bytes(table.cols)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_gguf_embedding_serves_gguf_values(gemma4_gguf, dtype):
    path, name, rows = gemma4_gguf
    ids = torch.from_numpy(rng.integers(0, VOCAB, (2, 7)))
    ids[0, :2] = torch.tensor([0, VOCAB - 1])
    layer = PackedGGUFEmbedding(path, TABLE, dtype=dtype)
    with layer.table:
        layer.table.reset_stats()
        out = layer(ids)
        stats = layer.table.stats()
    want = reference(rows, name, ids, dtype)
    assert_same_bits(out, want)
    # What a Gemma model takes of it: each decoder layer's slice of PER_LAYER values.
    assert_same_bits(out.reshape(2, 7, LAYERS, PER_LAYER)[..., 3, :],
                     want.reshape(2, 7, LAYERS, PER_LAYER)[..., 3, :])
    # Packed on disk and in the staged rows: a packed row's bytes per id.
    assert stats["rows"] == ids.numel()
    assert stats["bytes_copied"] == ids.numel() * rows.shape[1]


def test_disk_embedding_serves_gguf_values_and_reads_packed_rows(gemma4_gguf):
    path, name, rows = gemma4_gguf
    ids = torch.from_numpy(rng.integers(0, VOCAB, 33))
    with DiskEmbedding(ple.Table.from_gguf(path, TABLE), torch.float32) as layer:
        assert_same_bits(layer(ids), reference(rows, name, ids, torch.float32))
        assert np.array_equal(layer.table.gather_bytes(ids).numpy(), rows[ids.numpy()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("host_rows", [0, 100])
def test_cuda_serves_the_cpus_values_from_packed_staged_rows(gemma4_gguf, host_rows):
    path, name, rows = gemma4_gguf
    ids = torch.from_numpy(rng.integers(0, VOCAB, (3, 11)))
    layer = PackedGGUFEmbedding(path, TABLE, dtype=torch.bfloat16)
    with layer.table:
        layer.table.place(host_rows=host_rows)
        layer.table.reset_stats()
        out = layer(ids.cuda())
        stats = layer.table.stats()
        staging = layer.table.current_staging(torch.cuda.current_device())
        assert staging.row_bytes == rows.shape[1]
    assert out.device.type == "cuda"
    assert_same_bits(out, reference(rows, name, ids, torch.bfloat16))
    on_disk = int((ids >= host_rows).sum())
    assert stats["bytes_copied"] == on_disk * rows.shape[1]
