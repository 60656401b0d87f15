"""ple.layers: NGramEmbedding against rows gathered by hand from the table's
bytes and against transformers' own n-gram module over a checkpoint in its
layout, the constants of safetensors and GGUF files, PackedGGUFEmbedding
against gguf's dequantize, prefetch, argument
errors, torch.compile on CPU; on CUDA (skipped without a GPU) eager, compiled
with CUDA graphs and captured by hand, with tiers placed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers import assert_same_bits, assert_same_bits_but_nan, write_gguf
from ple.layers import NGramEmbedding, NGramHashing, PackedGGUFEmbedding

VOCAB_SIZE, EOS_ID, BASE_SIZE = 3000, 2, 300
HASHING = dict(vocab_size=VOCAB_SIZE, eos_id=EOS_ID, base_size=BASE_SIZE)
# Layer 3's rows sit after layer 0's in the same table.
LAYER_0 = dict(HASHING, ple_layer_index=0)
LAYER_3 = dict(HASHING, ple_layer_index=3, row_offset=NGramHashing(**LAYER_0).rows)
NGRAM_ROWS = NGramHashing(**LAYER_3).row_offset + NGramHashing(**LAYER_3).rows + 100  # and some unused
NGRAM_COLS = 24
SCALE = 0.37  # stored as F32
GGUF_ROWS, GGUF_COLS = VOCAB_SIZE, 64  # a token embedding: a row per token


@pytest.fixture(scope="module")
def ngram_checkpoint(tmp_path_factory):
    """A directory with the n-gram table in three shards over two files (random
    FP8 bytes, NaN patterns included) and the raw bytes it holds."""
    raw = np.random.default_rng(0).integers(0, 256, (NGRAM_ROWS, NGRAM_COLS), dtype=np.uint8)
    per_shard = -(-NGRAM_ROWS // 3)
    shards = {f"ngram_embedding.shard_{i}.weight":
              torch.from_numpy(raw[i * per_shard:(i + 1) * per_shard]).view(torch.float8_e4m3fn)
              for i in range(3)}
    directory = tmp_path_factory.mktemp("ngram")
    save_file({**dict(list(shards.items())[:2]),
               "ngram_embedding.weight_scale": torch.tensor(SCALE)},
              str(directory / "model-00001.safetensors"))
    save_file(dict(list(shards.items())[2:]), str(directory / "model-00002.safetensors"))
    return directory, raw


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A GGUF file with a Q8_0 token_embd.weight, a Q4_0 and a BF16 tensor."""
    values = np.random.default_rng(1).uniform(-2, 2, (GGUF_ROWS, GGUF_COLS)).astype(np.float32)
    tensors = {name: (gguf.quants.quantize(values, qtype), qtype) for name, qtype in (
        ("token_embd.weight", gguf.GGMLQuantizationType.Q8_0),
        ("q4_0", gguf.GGMLQuantizationType.Q4_0),
        ("bf16", gguf.GGMLQuantizationType.BF16))}
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    write_gguf(path, tensors)
    return path, tensors


def requests_batch(seed: int, num_tokens: int = 40, num_requests: int = 4):
    """Tokens of several requests back to back, EOS-heavy, each request with a
    context of two tokens (EOS or any)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB_SIZE, (num_tokens,), generator=generator)
    tokens[torch.rand(num_tokens, generator=generator) < 0.15] = EOS_ID
    seq_ids = torch.randint(0, num_requests, (num_tokens,), generator=generator).sort().values
    context = torch.randint(0, VOCAB_SIZE, (num_requests, 2), generator=generator)
    context[0] = EOS_ID
    context[1, 1] = EOS_ID
    return tokens, seq_ids, context


def ngram_reference(raw: np.ndarray, hashing: NGramHashing, batch, dtype) -> torch.Tensor:
    """The reference model's rows: the values and the F32 scale cast to
    ``dtype``, multiplied there (NGramEmbedding's default, round_scale=True)."""
    ids = hashing.row_ids(*batch).numpy()
    values = torch.from_numpy(raw[ids]).view(torch.float8_e4m3fn).to(dtype)
    scale = torch.tensor(SCALE, dtype=torch.float32).to(dtype)
    return (values * scale).reshape(len(ids), -1)


@pytest.fixture(scope="module")
def ngram_layers(ngram_checkpoint):
    directory, _ = ngram_checkpoint
    layers = {layer["ple_layer_index"]: NGramEmbedding.from_safetensors(directory, **layer)
              for layer in (LAYER_0, LAYER_3)}
    yield layers
    for layer in layers.values():
        layer.table.close()


@pytest.fixture(scope="module")
def token_embedding(gguf_file):
    layer = PackedGGUFEmbedding(gguf_file[0])
    yield layer
    layer.table.close()


# ---- values --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layer", [0, 3])
def test_ngram_embedding_equals_the_rows_gathered_by_hand(ngram_checkpoint, layer, dtype):
    directory, raw = ngram_checkpoint
    layer = NGramEmbedding.from_safetensors(directory, dtype=dtype,
                                            **(LAYER_0 if layer == 0 else LAYER_3))
    with layer.table:
        assert layer.table.num_rows == NGRAM_ROWS and layer.embedding_dim == 16 * NGRAM_COLS
        for seed, num_tokens in ((0, 40), (1, 1), (2, 300)):
            batch = requests_batch(seed, num_tokens)
            assert_same_bits(layer(*batch), ngram_reference(raw, layer.hashing, batch, dtype))
        tokens = requests_batch(3)[0]  # one request, no context
        assert_same_bits(layer(tokens), ngram_reference(raw, layer.hashing, (tokens,), dtype))


def test_ngram_embedding_from_gguf(gguf_file):
    path, tensors = gguf_file
    small = dict(HASHING, base_size=40, heads_per_ngram=2)
    layer = NGramEmbedding.from_gguf(path, "q4_0", ple_layer_index=1, dtype=torch.float32, **small)
    with layer.table:
        batch = requests_batch(4)
        ids = layer.hashing.row_ids(*batch).numpy()
        rows = gguf.quants.dequantize(tensors["q4_0"][0], gguf.GGMLQuantizationType.Q4_0)[ids]
        assert_same_bits(layer(*batch), torch.from_numpy(rows).reshape(len(ids), -1))


def qwen4exp_checkpoint(directory, config, ple_layer_index: int, parts: int, change_constants=False):
    """transformers' n-gram module of a PLE layer, its table saved as ``parts``
    shards with its buffers in transformers' layout (as save_pretrained
    writes them), and the module."""
    modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    from ple.layers.ngram_ids import decoder_layer

    layer = decoder_layer(config, ple_layer_index)
    torch.manual_seed(ple_layer_index)
    module = modeling.Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, layer, ple_layer_index)
    if change_constants:  # constants the config does not derive: only the file has them
        module.layer_multipliers.copy_(torch.tensor([3, 5, 7, 11]) * 1_000_003)
        module.ngram_heads_vocab_sizes.sub_(10)
    prefix = f"model.layers.{layer}.ple.ple_embedding"
    tensors = {f"{prefix}.ngram_embedding.shard_{i}.weight": shard.contiguous()
               for i, shard in enumerate(module.ngram_embedding.weight.detach().chunk(parts))}
    for buffer in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
        tensors[f"{prefix}.{buffer}"] = getattr(module, buffer)
    save_file(tensors, str(directory / f"model-layer{layer}.safetensors"))
    return module


def qwen4exp_config(**changes):
    configuration = pytest.importorskip("transformers.models.qwen4_exp.configuration_qwen4_exp")
    return configuration.Qwen4ExpTextConfig(**dict(
        vocab_size=VOCAB_SIZE, eos_token_id=[EOS_ID, 5], ple_layer_ids=[2, 3], num_hidden_layers=4,
        hidden_size=16, ple_embed_dim=24, ngram_size=4, heads_per_ngram=2, ngram_vocab_size_base=200,
        num_experts=2, num_experts_per_tok=1) | changes)


@pytest.mark.parametrize("change_constants", [False, True], ids=["derived", "file constants"])
def test_ngram_embedding_equals_transformers_module_over_its_checkpoint(tmp_path, change_constants):
    """A checkpoint in transformers' layout (each PLE layer's shards and buffers
    under its decoder layer): the layer found from the config alone gives the
    module's output bit for bit, with the file's constants where they differ
    from the derived ones."""
    config = qwen4exp_config()
    modules = [qwen4exp_checkpoint(tmp_path, config, index, parts=3, change_constants=change_constants)
               for index in (0, 1)]
    tokens = requests_batch(8, num_tokens=30)[0]
    for index, module in enumerate(modules):
        layer = NGramEmbedding.from_safetensors(tmp_path, model_config=config, ple_layer_index=index,
                                                dtype=torch.float32)
        with layer.table:
            assert layer.table.name == f"model.layers.{index + 1}.ple.ple_embedding.ngram_embedding"
            assert list(layer.hashing.multipliers) == module.layer_multipliers.tolist()
            assert list(layer.hashing.head_sizes) == module.ngram_heads_vocab_sizes.tolist()
            with torch.no_grad():
                expected = module(tokens[None], None)[0]
            assert_same_bits(layer(tokens), expected)


def test_ngram_embedding_reads_gguf_constants(tmp_path):
    """qwen4exp.ple.* metadata, two PLE layers back to back, and its EOS win
    over the derived values and the eos_id given."""
    values = np.random.default_rng(5).uniform(-1, 1, (400, 8)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "ple.gguf"), "qwen4exp")
    writer.add_array("qwen4exp.ple.layers", [2, 4])
    writer.add_array("qwen4exp.ple.layer_multipliers", [11, 13, 17, 19, 23, 29])
    writer.add_array("qwen4exp.ple.head_vocab_sizes", [31, 37, 41, 43])
    writer.add_array("qwen4exp.ple.head_offsets", [0, 31, 0, 41])
    writer.add_uint32("qwen4exp.ple.eos_token_id", 9)
    writer.add_tensor("per_layer_token_embd.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    layer = NGramEmbedding.from_gguf(tmp_path / "ple.gguf", "per_layer_token_embd.weight",
                                     vocab_size=VOCAB_SIZE, eos_id=EOS_ID, ngram_size=3, heads_per_ngram=1,
                                     ple_layer_index=1, dtype=torch.float32)
    with layer.table:
        assert layer.hashing.multipliers == (19, 23, 29) and layer.hashing.eos_id == 9
        assert layer.hashing.head_sizes == (41, 43) and layer.hashing.head_offsets == (0, 41)
        tokens = torch.tensor([4, 9, 6, 7])
        ids = layer.row_ids(tokens)
        prev = torch.tensor([9, 4, 9, 6])
        prev2 = torch.tensor([9, 9, 9, 9])  # EOS, or after an EOS
        mixed2 = (tokens * 19) ^ (prev * 23)
        assert torch.equal(ids, torch.stack([mixed2 % 41, (mixed2 ^ (prev2 * 29)) % 43 + 41], 1))
        assert_same_bits(layer(tokens), torch.from_numpy(values[ids.numpy()]).reshape(4, -1))


def test_ngram_embedding_refuses_a_fifo_for_a_gguf_file(tmp_path):
    """In a child with a timeout: reading a FIFO would block forever."""
    fifo = tmp_path / "ple.gguf"
    os.mkfifo(fifo)
    script = (f"from ple.layers import NGramEmbedding\n"
              f"try:\n    NGramEmbedding.from_gguf({str(fifo)!r}, 't', vocab_size=10, eos_id=1)\n"
              f"except ValueError as error:\n    print(error)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert f"{fifo}: not a regular file (a FIFO)" in done.stdout, done.stderr


@pytest.mark.parametrize("tensor", ["token_embd.weight", "q4_0", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_packed_gguf_embedding_equals_gguf_dequantize(gguf_file, tensor, dtype):
    path, tensors = gguf_file
    data, qtype = tensors[tensor]
    layer = PackedGGUFEmbedding(path, tensor, dtype)
    with layer.table:
        assert (layer.num_embeddings, layer.embedding_dim) == (GGUF_ROWS, GGUF_COLS)
        assert layer.table.format == qtype.name.lower()
        ids = torch.randint(0, GGUF_ROWS, (3, 17), generator=torch.Generator().manual_seed(5))
        ids[0, :2] = torch.tensor([0, GGUF_ROWS - 1])
        expected = torch.from_numpy(gguf.quants.dequantize(data, qtype)[ids.numpy()]).to(dtype)
        assert_same_bits(layer(ids), expected)
        assert_same_bits(layer(ids.int()), expected)


def test_prefetch_then_forward_takes_the_prefetched_rows(ngram_layers, token_embedding):
    batch = requests_batch(6)
    for layer, args in ((ngram_layers[3], batch), (token_embedding, batch[:1])):
        expected = layer(*args)
        layer.table.reset_stats()
        layer.prefetch(*args)
        assert_same_bits(layer(*args), expected)
        stats = layer.table.stats()
        assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (1, 0)


def test_ngram_embedding_with_a_host_tier(ngram_checkpoint):
    directory, raw = ngram_checkpoint
    layer = NGramEmbedding.from_safetensors(directory, **LAYER_0)
    with layer.table:
        layer.table.place(host_rows=NGRAM_ROWS // 2)
        batch = requests_batch(7)
        layer.prefetch(*batch)
        assert_same_bits(layer(*batch), ngram_reference(raw, layer.hashing, batch, torch.bfloat16))
        stats = layer.table.stats()
        assert stats["host_tier_hits"] > 0 and stats["prefetch_hits"] == 1


# ---- argument errors -----------------------------------------------------------------


def test_a_table_too_small_for_the_heads_is_named(ngram_checkpoint):
    directory, _ = ngram_checkpoint
    offset = NGRAM_ROWS - 10
    needed = offset + NGramHashing(**LAYER_0).rows
    with pytest.raises(ValueError, match=rf"^table 'ngram_embedding' has {NGRAM_ROWS} rows, but "
                       rf"PLE layer 0's 16 hash heads need rows \[{offset}, {needed}\)$"):
        NGramEmbedding.from_safetensors(directory, row_offset=offset, **LAYER_0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.float8_e4m3fn], ids=str)
def test_a_dtype_disk_gather_cannot_give_is_refused(ngram_checkpoint, gguf_file, dtype):
    message = (r"^dtype must be one of \(torch.float32, torch.float16, torch.bfloat16\), "
               rf"not {dtype}$")
    with pytest.raises(TypeError, match=message):
        NGramEmbedding.from_safetensors(ngram_checkpoint[0], dtype=dtype, **LAYER_0)
    with pytest.raises(TypeError, match=message):
        PackedGGUFEmbedding(gguf_file[0], dtype=dtype)


def test_the_hashing_needs_the_model_parameters(ngram_checkpoint):
    arguments = dict(LAYER_0)
    del arguments["vocab_size"]
    with pytest.raises(TypeError, match=r"^the hashing needs model_config, or vocab_size and eos_id "
                                        r"\(missing: vocab_size\)$"):
        NGramEmbedding.from_safetensors(ngram_checkpoint[0], **arguments)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'heads'"):
        NGramEmbedding.from_safetensors(ngram_checkpoint[0], heads=4, **LAYER_0)
    with pytest.raises(ValueError, match=r"^eos_id must be in \[0, vocab_size=3000\), got 3000$"):
        NGramEmbedding.from_safetensors(ngram_checkpoint[0], **dict(LAYER_0, eos_id=3000))


def test_missing_tables_are_named(ngram_checkpoint, gguf_file):
    directory, _ = ngram_checkpoint
    with pytest.raises(ValueError, match=r"no tensor or shard family named 'ple'"):
        NGramEmbedding.from_safetensors(directory, tensor="ple", **LAYER_0)
    path = gguf_file[0]
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: no tensor named 'output.weight'; 2-D tensors: "
                       r"\['bf16', 'q4_0', 'token_embd.weight'\]$"):
        PackedGGUFEmbedding(path, "output.weight")


# ---- torch.compile on the CPU --------------------------------------------------------


@pytest.mark.slow
def test_compiled_fullgraph_equals_eager_on_cpu(ngram_layers, token_embedding):
    """One compile of both layers (Inductor's C++ build takes seconds on 2 cores)."""
    from torch._dynamo.utils import counters

    def embed(tokens, seq_ids, context):
        return token_embedding(tokens), ngram_layers[0](tokens, seq_ids, context)

    counters.clear()
    compiled = torch.compile(embed, fullgraph=True)
    for seed in (8, 9):  # new ids, same shapes: one compile
        batch = requests_batch(seed)
        for got, want in zip(compiled(*batch), embed(*batch)):
            assert_same_bits(got, want)
    assert not counters["graph_break"]


# ---- CUDA ----------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_batch(seed: int):
    return [tensor.cuda() for tensor in requests_batch(seed, num_tokens=64)]


@pytest.fixture
def placed(ngram_layers, token_embedding):
    """Both layers with a device tier, a host tier and the rest on disk."""
    tables = [ngram_layers[0].table, token_embedding.table]
    for table in tables:
        table.place(device_rows=table.num_rows // 4, host_rows=table.num_rows // 4)
    yield ngram_layers[0], token_embedding
    for table in tables:
        table.place()


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_equals_cpu(ngram_checkpoint, gguf_file, dtype):
    layer = NGramEmbedding.from_safetensors(ngram_checkpoint[0], dtype=dtype, **LAYER_3)
    embedding = PackedGGUFEmbedding(gguf_file[0], dtype=dtype)
    with layer.table, embedding.table:
        for seed in (10, 11):
            batch = requests_batch(seed, num_tokens=200)
            on_gpu = layer(*(tensor.cuda() for tensor in batch))
            assert on_gpu.is_cuda
            assert_same_bits_but_nan(on_gpu, layer(*batch))
            assert_same_bits_but_nan(embedding(batch[0].cuda()), embedding(batch[0]))


@cuda
def test_cuda_prefetch(ngram_layers):
    layer = ngram_layers[0]
    batch = requests_batch(12)
    expected = layer(*batch)
    layer.table.reset_stats()
    layer.prefetch(*batch)
    assert_same_bits_but_nan(layer(*(tensor.cuda() for tensor in batch)), expected)
    assert layer.table.stats()["prefetch_hits"] == 1


@cuda
def test_cuda_compiled_with_cudagraphs_equals_eager(placed):
    from torch._dynamo.utils import counters

    ngram_layer, token_embedding = placed

    def embed(tokens, seq_ids, context):
        return token_embedding(tokens), ngram_layer(tokens, seq_ids, context)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(embed, fullgraph=True, mode="reduce-overhead")
    for seed in range(13, 18):  # warm-up, record, replays with new ids
        batch = cuda_batch(seed)
        for got, want in zip(compiled(*batch), embed(*batch)):
            assert_same_bits(got, want)
    assert not counters["graph_break"]
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert all(hits > 0 for hits in ngram_layer.table.tiers.hits())


@cuda
def test_cuda_graph_captured_by_hand_replays_new_ids(placed):
    ngram_layer, token_embedding = placed

    def embed(tokens, seq_ids, context):
        return token_embedding(tokens), ngram_layer(tokens, seq_ids, context)

    static = cuda_batch(18)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: kernels, head tensors
        embed(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = embed(*static)
    for seed in range(19, 23):
        batch = cuda_batch(seed)
        for destination, source in zip(static, batch):
            destination.copy_(source)
        graph.replay()
        for got, want in zip(captured, embed(*batch)):
            assert_same_bits(got, want)
