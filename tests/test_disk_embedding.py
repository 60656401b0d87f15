"""ple.layers.DiskEmbedding against torch.nn.functional.embedding of the
stored weight, to the bit: F32, F16 and BF16 tensors and a shard family in
their own dtype and cast to others (torch's cast), FP8 against torch's
float8 decode times the scale, GGUF tensors against gguf's dequantize; ids of
several shapes, int32 and int64; dtype following .to(); bad ids; the table's
lifetime; prefetch; torch.compile."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import ple
from helpers import assert_same_bits, assert_same_bits_but_nan, write_gguf
from ple.layers import DiskEmbedding
from ple.table import _open_tables

ROWS, COLS = 97, 24
FP8_SCALE = 0.0173
DTYPES = [None, torch.float32, torch.float16, torch.bfloat16]
ID_SHAPES = [(), (1,), (13,), (3, 5), (2, 3, 4)]


def special_values(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random float32 values with what casts round or keep specially: NaN,
    infinities, -0.0, subnormals, values past float16's range, halfway
    cases of bfloat16 rounding."""
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 3
    flat = values.view(-1)
    flat[:12] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -3e-39,
                              70000.0, -1e6, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 6e-8])
    return values


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Two safetensors files: F32, F16 and BF16 tensors, an F32 family of
    three shards over both files, an FP8 tensor with its scale and an FP8
    family with its weight_scale."""
    directory = tmp_path_factory.mktemp("disk_embedding")
    f32 = special_values(ROWS, COLS, 0)
    shards = [special_values(40, COLS, 1), special_values(40, COLS, 2), special_values(17, COLS, 3)]
    fp8 = torch.from_numpy(np.random.default_rng(4).integers(0, 256, (ROWS, COLS), dtype=np.uint8))
    weights = {
        "f32": f32,
        "f16": special_values(ROWS, COLS, 5).to(torch.float16),
        "bf16": special_values(ROWS, COLS, 6).to(torch.bfloat16),
        "fp8": fp8.view(torch.float8_e4m3fn),
        "fp8_scale": torch.tensor(FP8_SCALE),
        "fp8fam.shard_0.weight": fp8[:50].clone().view(torch.float8_e4m3fn),
        "fp8fam.shard_1.weight": fp8[50:].clone().view(torch.float8_e4m3fn),
        "fp8fam.weight_scale": torch.tensor(FP8_SCALE),
    }
    save_file({**weights, "fam.shard_0.weight": shards[0], "fam.shard_2.weight": shards[2]},
              str(directory / "a.safetensors"))
    save_file({"fam.shard_1.weight": shards[1]}, str(directory / "b.safetensors"))
    weights["fam"] = torch.cat(shards)
    weights["fp8fam"] = weights["fp8"]
    return directory, weights


def all_ids(shape, dtype, seed=0) -> torch.Tensor:
    ids = torch.randint(0, ROWS, shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    if ids.numel() >= 2:
        ids.view(-1)[:2] = torch.tensor([0, ROWS - 1])
    return ids


@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "fam"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_equals_embedding_of_stored_weight(checkpoint, name, dtype):
    directory, weights = checkpoint
    stored = weights[name]
    want_dtype = stored.dtype if dtype is None else dtype
    with DiskEmbedding.from_safetensors(directory, name, dtype=dtype) as embedding:
        assert (embedding.num_embeddings, embedding.embedding_dim) == (ROWS, COLS)
        assert embedding.dtype == want_dtype
        for shape in ID_SHAPES:
            for id_dtype in (torch.int64, torch.int32):
                ids = all_ids(shape, id_dtype, seed=len(shape))
                got = embedding(ids)
                assert got.shape == (*shape, COLS)
                # torch's own cast of the stored weight, then its lookup.
                assert_same_bits(got, F.embedding(ids, stored.to(want_dtype)))


@pytest.mark.parametrize("name", ["fp8", "fp8fam"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_fp8_equals_torch_decode_times_scale(checkpoint, name, dtype):
    directory, weights = checkpoint
    scale = torch.tensor(FP8_SCALE, dtype=torch.float32).item()
    decoded = weights[name].to(torch.float32) * scale
    with DiskEmbedding.from_safetensors(directory, name, dtype=dtype) as embedding:
        assert embedding.table.scale == scale
        assert embedding.dtype == (torch.float32 if dtype is None else dtype)
        ids = all_ids((6, 9), torch.int64)
        assert_same_bits(embedding(ids), F.embedding(ids, decoded.to(embedding.dtype)))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "F16"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_gguf_equals_dequantize(tmp_path, qtype, dtype):
    values = np.random.default_rng(7).uniform(-2, 2, (ROWS, 64)).astype(np.float32)
    q = gguf.GGMLQuantizationType[qtype]
    data = values.astype(np.float16) if qtype == "F16" else gguf.quants.quantize(values, q)
    write_gguf(tmp_path / "m.gguf", {"token_embd.weight": (data, q)})
    weight = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, q)))
    with DiskEmbedding.from_gguf(tmp_path / "m.gguf", "token_embd.weight", dtype=dtype) as embedding:
        assert embedding.table.format == qtype.lower()
        want_dtype = embedding.dtype
        assert want_dtype == (torch.float16 if qtype == "F16" and dtype is None else
                              dtype or torch.float32)
        for id_dtype in (torch.int64, torch.int32):
            ids = all_ids((4, 7), id_dtype)
            assert_same_bits(embedding(ids), F.embedding(ids, weight.to(want_dtype)))


def test_dtype_follows_module_casts(checkpoint):
    directory, weights = checkpoint
    stored = weights["f32"]
    ids = all_ids((5, 3), torch.int64)
    with DiskEmbedding.from_safetensors(directory, "f32") as embedding:
        for cast, dtype in ((lambda m: m.to(torch.bfloat16), torch.bfloat16),
                            (lambda m: m.half(), torch.float16),
                            (lambda m: m.double(), torch.float64),
                            (lambda m: m.float(), torch.float32),
                            (lambda m: m.to("cpu"), torch.float32)):
            assert cast(embedding) is embedding
            assert embedding.dtype == dtype
            assert embedding.weight.dtype == dtype
            got, want = embedding(ids), F.embedding(ids, stored.to(dtype))
            assert got.dtype == dtype
            if dtype == torch.float64:
                assert torch.equal(got.view(torch.int64), want.view(torch.int64))
            else:
                assert_same_bits(got, want)


def test_module_has_no_parameters_and_a_meta_weight(checkpoint):
    directory, weights = checkpoint
    with DiskEmbedding.from_safetensors(directory, "bf16", padding_idx=3) as embedding:
        assert list(embedding.parameters()) == []
        state = embedding.state_dict()  # the table, as the file holds it (test_whole_save.py)
        assert list(state) == ["weight"]
        assert_same_bits(state["weight"], weights["bf16"])
        weight = embedding.weight
        assert weight.device.type == "meta"
        assert (tuple(weight.shape), weight.dtype) == ((ROWS, COLS), torch.bfloat16)
        with pytest.raises(AttributeError, match="cannot be assigned"):
            embedding.weight = torch.nn.Parameter(torch.zeros(ROWS, COLS))
        text = repr(embedding)
        assert f"{ROWS}, {COLS}, table='bf16' (bf16), dtype=torch.bfloat16, padding_idx=3" in text


def test_built_under_meta_device_still_runs(checkpoint):
    """transformers builds models under `with torch.device("meta")`."""
    directory, weights = checkpoint
    table = ple.Table.from_safetensors(directory, "f16")
    with torch.device("meta"):
        embedding = DiskEmbedding(table)
    ids = all_ids((4,), torch.int64)
    assert_same_bits(embedding(ids), F.embedding(ids, weights["f16"]))
    embedding.close()


def test_bad_ids_raise(checkpoint):
    directory, _ = checkpoint
    with DiskEmbedding.from_safetensors(directory, "fam") as embedding:
        for bad in (ROWS, -1, 1 << 40):
            with pytest.raises(IndexError, match=rf"out of range \[0, {ROWS}\)"):
                embedding(torch.tensor([[0, 1], [bad, 2]]))
        with pytest.raises(TypeError, match="int32 or int64"):
            embedding(torch.tensor([0.0, 1.0]))
        with pytest.raises(TypeError, match="int32 or int64"):
            embedding(torch.tensor([0, 1], dtype=torch.int16))


def test_owns_and_closes_its_table(checkpoint):
    directory, _ = checkpoint
    before = len(_open_tables)
    embedding = DiskEmbedding.from_safetensors(directory, "f32")
    assert len(_open_tables) == before + 1
    embedding.close()
    assert len(_open_tables) == before
    with pytest.raises(ValueError, match="closed"):
        embedding(torch.tensor([0]))
    # A module that cannot be made closes the table it opened.
    with pytest.raises(TypeError, match="dtype must be one of"):
        DiskEmbedding.from_safetensors(directory, "f32", dtype=torch.int32)
    with pytest.raises(TypeError, match="dtype must be one of"):
        DiskEmbedding.from_safetensors(directory, "fam", dtype=torch.float8_e4m3fn)
    assert len(_open_tables) == before


def test_prefetch_serves_the_next_forward(checkpoint):
    directory, weights = checkpoint
    ids = all_ids((3, 11), torch.int64, seed=5)
    with DiskEmbedding.from_safetensors(directory, "fam", config=ple.GatherConfig(threads=1)) as embedding:
        embedding.prefetch(ids)
        got = embedding(ids)
        stats = embedding.table.stats()
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (1, 0)
    assert_same_bits(got, F.embedding(ids, weights["fam"]))


def test_compiled_equals_eager(checkpoint):
    directory, weights = checkpoint

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = DiskEmbedding.from_safetensors(directory, "fam", dtype=torch.bfloat16)

        def forward(self, ids):
            rows = self.embedding(ids)
            # As a transformers module would: read the weight's device and dtype.
            assert self.embedding.weight.device.type == "meta"
            return rows * 2 + 1

    model = Model()
    compiled = torch.compile(model, fullgraph=True)
    for seed in range(2):
        ids = all_ids((2, 6), torch.int64, seed=seed)
        want = F.embedding(ids, weights["fam"].to(torch.bfloat16)) * 2 + 1
        assert_same_bits(compiled(ids), want)
    model.embedding.close()


# ---- CUDA (skipped without a GPU) -------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "fam", "fp8", "fp8fam"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_cuda_equals_torch_on_the_gpu(checkpoint, name, dtype):
    """CUDA ids: the rows come from disk_gather's CUDA kernel (staged, then
    decoded by Triton), equal to F.embedding of torch's own cast on the GPU
    to the bit but for NaN, which is NaN in both with each one's payload
    (README, "NaN": the Triton kernel writes bfloat16 NaN as 0x7FC0, torch's
    CUDA cast otherwise; the GPU's multiply by an FP8 scale its own)."""
    directory, weights = checkpoint
    stored = weights[name]
    with DiskEmbedding.from_safetensors(directory, name, dtype=dtype) as embedding:
        embedding.to("cuda")
        assert embedding.dtype_tracker.is_cuda
        weight = stored.cuda()
        if name.startswith("fp8"):
            weight = weight.to(torch.float32) * embedding.table.scale
        weight = weight.to(embedding.dtype)
        for shape in ((13,), (3, 5)):
            for id_dtype in (torch.int64, torch.int32):
                ids = all_ids(shape, id_dtype).cuda()
                got = embedding(ids)
                assert got.is_cuda
                assert_same_bits_but_nan(got, F.embedding(ids, weight))


@cuda
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_cuda_gguf_equals_dequantize(tmp_path, qtype):
    values = np.random.default_rng(8).uniform(-2, 2, (ROWS, 64)).astype(np.float32)
    q = gguf.GGMLQuantizationType[qtype]
    data = gguf.quants.quantize(values, q)
    write_gguf(tmp_path / "m.gguf", {"token_embd.weight": (data, q)})
    weight = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, q)))
    with DiskEmbedding.from_gguf(tmp_path / "m.gguf", "token_embd.weight",
                                 dtype=torch.bfloat16) as embedding:
        ids = all_ids((4, 7), torch.int64)
        got = embedding.cuda()(ids.cuda())
        assert got.is_cuda
        assert_same_bits(got, F.embedding(ids, weight).to(torch.bfloat16))
