"""Lookahead (ple.layers.lookahead): a prompt's prefill chunks through the
layers with their rows read ahead give the bytes of the same forwards
without it, for chunks of one token, a partial last chunk and one chunk;
every chunk after a plan starts is a prefetch hit; the rows read ahead stay
within the bound; a forward of another size ends the plan; end_lookahead
leaves no prefetch behind and no read running; with a row cache and direct
I/O, compiled, and on CUDA (skipped without a GPU)."""

from __future__ import annotations

import time

import pytest
import torch

from helpers import assert_same_bits, assert_same_bits_but_nan
from ple import GatherConfig
from ple.layers import DiskEmbedding, NGramEmbedding
from ple.layers.lookahead import MOST_BYTES
from test_layers import LAYER_0, VOCAB_SIZE, EOS_ID, ngram_checkpoint  # noqa: F401 (fixture)

PROMPT_TOKENS = 23
CONTEXT = 2  # tokens of history of the layers' 3-grams


def prompt(seed: int = 0) -> torch.Tensor:
    """One request's tokens, with EOS in it."""
    tokens = torch.randint(0, VOCAB_SIZE, (PROMPT_TOKENS,),
                           generator=torch.Generator().manual_seed(seed))
    tokens[[5, 6, 15]] = EOS_ID
    return tokens


def chunks_of(tokens: torch.Tensor, chunk_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each chunk of ``tokens`` with the context a forward of it takes (the
    tokens before it, EOS before the prompt)."""
    history = torch.cat([torch.full((CONTEXT,), EOS_ID), tokens])
    return [(chunk, history[start:start + CONTEXT].view(1, CONTEXT))
            for start, chunk in zip(range(0, len(tokens), chunk_size), tokens.split(chunk_size))]


def forward_chunks(layer, tokens: torch.Tensor, chunk_size: int, device="cpu") -> list[torch.Tensor]:
    return [layer(chunk.to(device), torch.zeros(len(chunk), dtype=torch.int64, device=device),
                  context.to(device))
            for chunk, context in chunks_of(tokens, chunk_size)]


@pytest.fixture(params=["mmap", "row cache", "direct"])
def layer(request, ngram_checkpoint):  # noqa: F811
    config = {"mmap": None, "row cache": GatherConfig(row_cache_mib=4),
              "direct": GatherConfig(io="direct", threads=1, row_cache_mib=4)}[request.param]
    opened = NGramEmbedding.from_safetensors(ngram_checkpoint[0], config=config, **LAYER_0)
    with opened.table:
        yield opened


@pytest.mark.parametrize("chunk_size", [1, 7, PROMPT_TOKENS, 2 * PROMPT_TOKENS])
def test_chunks_read_ahead_give_the_same_bytes_and_hit(layer, chunk_size):
    tokens = prompt()
    expected = forward_chunks(layer, tokens, chunk_size)
    layer.table.reset_stats()
    layer.lookahead(tokens, chunk_size)
    got = forward_chunks(layer, tokens, chunk_size)
    for chunk_rows, want in zip(got, expected):
        assert_same_bits(chunk_rows, want)
    stats = layer.table.stats()
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (len(expected), 0)
    assert not layer.looking_ahead and layer.lookahead_bytes == 0


def test_the_rows_read_ahead_stay_within_the_bound(layer):
    tokens = prompt(1)
    chunk_bytes = 3 * layer.hashing.heads * layer.table.row_bytes  # 3 tokens a chunk
    layer.lookahead(tokens, 3, max_bytes=2 * chunk_bytes)
    seen = [layer.lookahead_bytes]
    for chunk, context in chunks_of(tokens, 3):
        layer(chunk, torch.zeros(len(chunk), dtype=torch.int64), context)
        seen.append(layer.lookahead_bytes)
    assert max(seen) == 2 * chunk_bytes
    assert seen[-1] == 0


def test_a_forward_of_another_size_ends_the_plan(layer):
    tokens = prompt(2)
    first, second = chunks_of(tokens, 4)[:2]
    expected = layer(second[0][:3], torch.zeros(3, dtype=torch.int64), second[1])
    layer.lookahead(tokens, 4)
    layer(first[0], torch.zeros(4, dtype=torch.int64), first[1])
    assert layer.looking_ahead
    got = layer(second[0][:3], torch.zeros(3, dtype=torch.int64), second[1])
    assert_same_bits(got, expected)
    assert not layer.looking_ahead


def test_ending_a_plan_leaves_no_prefetch_and_no_read(layer):
    tokens = prompt(3)
    layer.lookahead(tokens, 2)
    chunks = chunks_of(tokens, 2)
    layer(chunks[0][0], torch.zeros(2, dtype=torch.int64), chunks[0][1])
    layer.end_lookahead()
    after_end = layer.table.stats()
    time.sleep(0.2)  # a read left running would count here
    assert layer.table.stats()["calls"] == after_end["calls"]
    layer.table.reset_stats()
    layer(chunks[1][0], torch.zeros(2, dtype=torch.int64), chunks[1][1])
    stats = layer.table.stats()
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (0, 0)  # nothing was pending
    assert not layer.looking_ahead


def test_a_disk_embedding_plan_splits_the_length_of_a_batch(tmp_path):
    from helpers import write_fp8_table

    path = write_fp8_table(tmp_path / "t.safetensors", rows=500)
    with DiskEmbedding.from_safetensors(path) as embedding:
        ids = torch.randint(0, 500, (3, 17), generator=torch.Generator().manual_seed(4))
        expected = [embedding(chunk) for chunk in ids.split(5, dim=-1)]
        embedding.table.reset_stats()
        embedding.lookahead(ids, 5)
        for chunk, want in zip(ids.split(5, dim=-1), expected):
            assert_same_bits(embedding(chunk), want)
        assert embedding.table.stats()["prefetch_hits"] == len(expected)


@pytest.mark.parametrize("bad", [0, -1, MOST_BYTES + 1, 1.5])
def test_a_bad_bound_is_refused(layer, bad):
    with pytest.raises(ValueError, match=r"lookahead max_bytes must be an int in \(0, "):
        layer.lookahead(prompt(), 4, max_bytes=bad)
    assert not layer.looking_ahead


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_a_bad_chunk_size_is_refused(layer, bad):
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        layer.lookahead(prompt(), bad)


def test_compiled_forwards_read_ahead(ngram_checkpoint):  # noqa: F811
    layer = NGramEmbedding.from_safetensors(ngram_checkpoint[0], **LAYER_0)
    with layer.table:
        tokens = prompt(5)
        expected = forward_chunks(layer, tokens, 8)
        compiled = torch.compile(layer)
        forward_chunks(compiled, tokens, 8)  # compiles, without a plan and with one
        layer.lookahead(tokens, 8)
        forward_chunks(compiled, tokens, 8)
        layer.table.reset_stats()
        layer.lookahead(tokens, 8)
        for got, want in zip(forward_chunks(compiled, tokens, 8), expected):
            assert_same_bits(got, want)
        assert layer.table.stats()["prefetch_hits"] == len(expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_chunks_read_ahead(layer):
    tokens = prompt(6)
    expected = forward_chunks(layer, tokens, 5)
    layer.table.reset_stats()
    layer.lookahead(tokens, 5)
    for got, want in zip(forward_chunks(layer, tokens, 5, device="cuda"), expected):
        assert_same_bits_but_nan(got, want)
    torch.cuda.synchronize()
    assert layer.table.stats()["prefetch_hits"] == len(expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_the_bound_holds_while_the_host_runs_ahead_of_the_stream(layer):
    """The stream sleeps first, so every forward is enqueued before any of
    its gathers runs: chunks forwarded but not gathered still count, and the
    forwards wait for the stream rather than read more ahead."""
    tokens = prompt(7)
    expected = forward_chunks(layer, tokens, 3)
    chunk_bytes = 3 * layer.hashing.heads * layer.table.row_bytes
    layer.table.reset_stats()
    layer.lookahead(tokens, 3, max_bytes=2 * chunk_bytes)
    torch.cuda._sleep(50_000_000)
    got, seen = [], []
    for chunk, context in chunks_of(tokens, 3):
        got.append(layer(chunk.cuda(), torch.zeros(len(chunk), dtype=torch.int64, device="cuda"),
                         context.cuda()))
        seen.append(layer.lookahead_bytes)
    assert max(seen) <= 2 * chunk_bytes
    for rows, want in zip(got, expected):
        assert_same_bits_but_nan(rows, want)
    torch.cuda.synchronize()
    assert layer.table.stats()["prefetch_hits"] == len(expected)
