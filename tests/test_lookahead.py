"""Lookahead (ple.layers.lookahead): a prompt's prefill chunks through the
layers with their rows read ahead give the bytes of the same forwards
without it, for chunks of one token, a partial last chunk and one chunk;
every chunk after a plan starts is a prefetch hit; the rows read ahead stay
within the bound, and lookahead_bytes is what the table holds; a forward of
another size ends the plan; end_lookahead leaves no prefetch behind and no
read running; with a row cache and direct I/O, compiled, and on CUDA
(skipped without a GPU).

The bound whatever the forwards do: forwards of the planned sizes but other
ids, a forward that raises, plans of two layers on one table, forwards on
six threads while another plans anew, end_lookahead after close, a copy of
a layer that looks ahead; and a prefetch taken by a gather padded after
its ids.

The plan lives in the table and advances inside the gathers: a model
compiled with fullgraph=True and a CUDA graph captured once and replayed
per chunk (and torch.compile's own CUDA graphs) give the eager bits and
hits; layers collected mid-plan give back their rows and row-cache pins;
the three layers answer row_ids and lookahead with one signature; the
bound in MiB of the integrations is checked by one function."""

from __future__ import annotations

import copy
import gc
import sys
import threading
import time

import pytest
import torch

import ple
from helpers import assert_same_bits, assert_same_bits_but_nan, write_fp8_table
from ple import GatherConfig, Table
from ple.kernels.native import native
from ple.layers import DiskEmbedding, NGramEmbedding
from ple.layers.lookahead import MOST_BYTES, lookahead_mib
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
    layer.lookahead(layer.row_ids(tokens), chunk_size)
    got = forward_chunks(layer, tokens, chunk_size)
    for chunk_rows, want in zip(got, expected):
        assert_same_bits(chunk_rows, want)
    stats = layer.table.stats()
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (len(expected), 0)
    assert not layer.looking_ahead and layer.lookahead_bytes == 0


def test_the_rows_read_ahead_stay_within_the_bound(layer):
    tokens = prompt(1)
    chunk_bytes = 3 * layer.hashing.heads * layer.table.row_bytes  # 3 tokens a chunk
    layer.lookahead(layer.row_ids(tokens), 3, max_bytes=2 * chunk_bytes)
    seen = [layer.lookahead_bytes]
    for chunk, context in chunks_of(tokens, 3):
        layer(chunk, torch.zeros(len(chunk), dtype=torch.int64), context)
        seen.append(layer.lookahead_bytes)
        assert seen[-1] == layer.table.prefetched_bytes()
    assert max(seen) == 2 * chunk_bytes
    assert seen[-1] == 0


def test_a_forward_of_another_size_ends_the_plan(layer):
    tokens = prompt(2)
    first, second = chunks_of(tokens, 4)[:2]
    expected = layer(second[0][:3], torch.zeros(3, dtype=torch.int64), second[1])
    layer.lookahead(layer.row_ids(tokens), 4)
    layer(first[0], torch.zeros(4, dtype=torch.int64), first[1])
    assert layer.looking_ahead
    got = layer(second[0][:3], torch.zeros(3, dtype=torch.int64), second[1])
    assert_same_bits(got, expected)
    assert not layer.looking_ahead


def test_ending_a_plan_leaves_no_prefetch_and_no_read(layer):
    tokens = prompt(3)
    layer.lookahead(layer.row_ids(tokens), 2)
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
        layer.lookahead(layer.row_ids(prompt()), 4, max_bytes=bad)
    assert not layer.looking_ahead


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_a_bad_chunk_size_is_refused(layer, bad):
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        layer.lookahead(layer.row_ids(prompt()), bad)


def test_compiled_forwards_read_ahead(ngram_checkpoint):  # noqa: F811
    layer = NGramEmbedding.from_safetensors(ngram_checkpoint[0], **LAYER_0)
    with layer.table:
        tokens = prompt(5)
        expected = forward_chunks(layer, tokens, 8)
        compiled = torch.compile(layer)
        forward_chunks(compiled, tokens, 8)  # compiles, without a plan and with one
        layer.lookahead(layer.row_ids(tokens), 8)
        forward_chunks(compiled, tokens, 8)
        layer.table.reset_stats()
        layer.lookahead(layer.row_ids(tokens), 8)
        for got, want in zip(forward_chunks(compiled, tokens, 8), expected):
            assert_same_bits(got, want)
        assert layer.table.stats()["prefetch_hits"] == len(expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_chunks_read_ahead(layer):
    tokens = prompt(6)
    expected = forward_chunks(layer, tokens, 5)
    layer.table.reset_stats()
    layer.lookahead(layer.row_ids(tokens), 5)
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
    layer.lookahead(layer.row_ids(tokens), 3, max_bytes=2 * chunk_bytes)
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


# The bound whatever the forwards do: a DiskEmbedding over 2,000 rows of 160 B,
# chunks of CHUNK ids (8,000 B of rows), two chunks ahead at most.
CHUNK = 50
ROWS = 2000


@pytest.fixture
def embedding(tmp_path):
    with DiskEmbedding.from_safetensors(write_fp8_table(tmp_path / "t.safetensors", ROWS)) as opened:
        yield opened


def random_ids(seed: int, chunks: int) -> torch.Tensor:
    """``chunks`` chunks of ids, as a prompt [1, chunks * CHUNK]."""
    return torch.randint(0, ROWS, (1, chunks * CHUNK), generator=torch.Generator().manual_seed(seed))


def all_rows(embedding) -> torch.Tensor:
    """Every row of the table, gathered without a plan: the reference."""
    return embedding(torch.arange(ROWS))


def test_forwards_of_other_ids_end_the_plan_and_leave_nothing_held(embedding):
    """Forwards of the planned size but other ids: the first one ends the
    plan and drops what it read ahead; nothing is held while the others run
    nor after; the planned ids then find no prefetch."""
    table, reference = embedding.table, all_rows(embedding)
    planned, other = random_ids(0, 10), random_ids(1, 10)
    bound = 2 * CHUNK * table.row_bytes
    embedding.lookahead(planned, CHUNK, max_bytes=bound)
    assert embedding.lookahead_bytes == table.prefetched_bytes() == bound
    for chunk in other.split(CHUNK, dim=-1):
        assert_same_bits(embedding(chunk), reference[chunk])
        assert not embedding.looking_ahead
        assert embedding.lookahead_bytes == table.prefetched_bytes() == 0
    table.reset_stats()
    for chunk in planned.split(CHUNK, dim=-1):
        embedding(chunk)
    assert (table.stats()["prefetch_hits"], table.stats()["prefetch_misses"]) == (0, 0)


def test_a_forward_that_misses_mid_plan_ends_it(embedding):
    table, reference = embedding.table, all_rows(embedding)
    planned = random_ids(2, 6)
    chunks = list(planned.split(CHUNK, dim=-1))
    chunks[2] = random_ids(3, 1)
    table.reset_stats()
    embedding.lookahead(planned, CHUNK, max_bytes=2 * CHUNK * table.row_bytes)
    for k, chunk in enumerate(chunks):
        assert_same_bits(embedding(chunk), reference[chunk])
        assert embedding.looking_ahead == (k < 2)
    assert table.stats()["prefetch_hits"] == 2
    assert embedding.lookahead_bytes == table.prefetched_bytes() == 0


def test_a_forward_that_raises_ends_its_plan_alone(embedding):
    """Two layers over one table, each with a plan: the first's forward of
    an id out of range raises and ends its plan, and the second's chunks all
    come from its prefetches, before and after the first's end_lookahead."""
    table = embedding.table
    other = DiskEmbedding(table)
    reference = all_rows(embedding)
    mine, theirs = random_ids(4, 5), random_ids(5, 5)
    table.reset_stats()
    embedding.lookahead(mine, CHUNK)
    other.lookahead(theirs, CHUNK)
    their_chunks = list(theirs.split(CHUNK, dim=-1))
    embedding(mine[:, :CHUNK])
    other(their_chunks[0])
    bad = mine[:, CHUNK:2 * CHUNK].clone()
    bad[0, 7] = ROWS
    with pytest.raises(IndexError, match=f"row id {ROWS} at position 7 is out of range"):
        embedding(bad)
    assert not embedding.looking_ahead and embedding.lookahead_bytes == 0
    assert other.lookahead_bytes == table.prefetched_bytes() > 0
    other(their_chunks[1])
    embedding.end_lookahead()
    for chunk in their_chunks[2:]:
        assert_same_bits(other(chunk), reference[chunk])
    assert table.stats()["prefetch_hits"] == 1 + len(their_chunks)
    assert table.prefetched_bytes() == 0


def test_end_lookahead_drops_only_its_own_plans_prefetches(embedding):
    table = embedding.table
    other = DiskEmbedding(table)
    mine, theirs = random_ids(6, 4), random_ids(7, 4)
    embedding.lookahead(mine, CHUNK)
    other.lookahead(theirs, CHUNK)
    both = table.prefetched_bytes()
    embedding.end_lookahead()
    assert table.prefetched_bytes() == other.lookahead_bytes == both // 2
    table.reset_stats()
    for chunk in theirs.split(CHUNK, dim=-1):
        other(chunk)
    assert table.stats()["prefetch_hits"] == 4


def test_end_lookahead_after_close_does_nothing(embedding):
    embedding.lookahead(random_ids(8, 3), CHUNK)
    embedding.close()
    embedding.end_lookahead()
    assert not embedding.looking_ahead and embedding.lookahead_bytes == 0


def test_a_copy_of_a_layer_that_looks_ahead_has_no_plan(embedding):
    planned = random_ids(9, 3)
    embedding.lookahead(planned, CHUNK)
    copied = copy.deepcopy(embedding)
    with copied.table:
        assert not copied.looking_ahead and copied.table.prefetched_bytes() == 0
    assert embedding.looking_ahead
    embedding.table.reset_stats()
    for chunk in planned.split(CHUNK, dim=-1):
        embedding(chunk)
    assert embedding.table.stats()["prefetch_hits"] == 3


def test_forwards_on_six_threads_while_another_plans_anew(embedding):
    """Six threads forward chunks of the planned size, planned ids or not,
    while a seventh plans again and again: each forward gives its rows, no
    thread raises, the bound holds, and the end leaves nothing held."""
    table, reference = embedding.table, all_rows(embedding)
    planned = random_ids(10, 8)
    chunks = list(planned.split(CHUNK, dim=-1)) + list(random_ids(11, 4).split(CHUNK, dim=-1))
    bound = 2 * CHUNK * table.row_bytes
    errors, held = [], []
    stop = time.monotonic() + 1.5

    def forwards(seed):
        order = torch.randint(0, len(chunks), (10_000,), generator=torch.Generator().manual_seed(seed))
        try:
            for k in order.tolist():
                if time.monotonic() > stop:
                    return
                if not torch.equal(embedding(chunks[k]), reference[chunks[k]]):
                    errors.append(f"chunk {k}: other rows")
        except BaseException as error:  # noqa: BLE001 (reported by the test)
            errors.append(repr(error))

    def plans():
        try:
            while time.monotonic() < stop:
                embedding.lookahead(planned, CHUNK, max_bytes=bound)
                held.append(table.prefetched_bytes())
        except BaseException as error:  # noqa: BLE001
            errors.append(repr(error))

    threads = [threading.Thread(target=forwards, args=(seed,)) for seed in range(6)]
    threads.append(threading.Thread(target=plans))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch between any two steps of a forward
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert held and max(held) <= bound
    embedding.end_lookahead()
    assert table.prefetched_bytes() == 0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_prefetch_serves_a_gather_padded_after_its_ids(embedding, dtype):
    """As a CUDA graph pads a batch: the gather of the prefetched ids and
    then others takes the prefetch's rows and reads the rest; a gather of
    fewer ids, or of the ids not first, takes nothing."""
    table, reference = embedding.table, all_rows(embedding)
    ids = random_ids(12, 1)[0]
    padded = torch.cat([ids, torch.zeros(14, dtype=torch.int64)]).to(dtype)
    table.reset_stats()
    table.prefetch(ids)
    assert_same_bits(embedding(padded), reference[padded.long()])
    assert (table.stats()["prefetch_hits"], table.prefetched_bytes()) == (1, 0)
    table.prefetch(ids)
    for not_first in (ids[:-1], torch.cat([torch.zeros(1, dtype=torch.int64), ids])):
        assert_same_bits(embedding(not_first.to(dtype)), reference[not_first])
    assert (table.stats()["prefetch_hits"], table.stats()["prefetch_misses"]) == (1, 2)
    assert table.drop_prefetches() == len(ids) * table.row_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_forwards_of_other_ids_stay_within_the_bound(embedding):
    """The stream sleeps first, so the forwards are enqueued before their
    gathers run: the plan counts them until the stream passes them, then
    finds them missed, ends, and holds nothing."""
    table, reference = embedding.table, all_rows(embedding)
    planned, other = random_ids(13, 8), random_ids(14, 8)
    bound = 2 * CHUNK * table.row_bytes
    embedding.lookahead(planned, CHUNK, max_bytes=bound)
    torch.cuda._sleep(50_000_000)
    got = []
    for chunk in other.split(CHUNK, dim=-1):
        got.append(embedding(chunk.cuda()))
        assert table.prefetched_bytes() <= bound
    for rows, chunk in zip(got, other.split(CHUNK, dim=-1)):
        assert_same_bits(rows, reference[chunk])
    torch.cuda.synchronize()
    assert embedding.lookahead_bytes == 0
    embedding.end_lookahead()
    assert table.prefetched_bytes() == 0


# Compiled with fullgraph=True, and captured in a CUDA graph: the plan advances
# inside the gathers, so the forwards have nothing of their own to do.

class TinyModel(torch.nn.Module):
    """A DiskEmbedding inside a model: its rows times a weight of each column
    (one product a value, rounded alike eager and compiled, on any device)."""

    def __init__(self, table):
        super().__init__()
        self.embedding = DiskEmbedding(table, torch.float32)
        self.weight = torch.nn.Parameter(torch.randn(table.cols))

    def forward(self, ids):
        return self.embedding(ids) * self.weight


def chunked_forwards(model, planned: torch.Tensor, device="cpu") -> tuple[list, int]:
    """The chunks of ``planned`` through ``model`` with a plan over them: the
    outputs and the table's prefetch hits."""
    table = model.embedding.table
    table.reset_stats()
    model.embedding.lookahead(planned, CHUNK, max_bytes=2 * CHUNK * table.row_bytes)
    with torch.no_grad():
        # A clone each: a CUDA graph's replay writes its outputs over the last one's.
        got = [model(chunk.to(device)).clone() for chunk in planned.split(CHUNK, dim=-1)]
    if device != "cpu":
        torch.cuda.synchronize()
    assert not model.embedding.looking_ahead and table.prefetched_bytes() == 0
    return got, table.stats()["prefetch_hits"]


@pytest.mark.slow
def test_a_model_compiled_with_fullgraph_reads_ahead_as_eager(embedding):
    """Eager and compiled with fullgraph=True (where a graph break is an
    error): the same bits and a hit for every chunk, and a forward of other
    ids ends the plan in the compiled model too."""
    torch.manual_seed(0)
    model = TinyModel(embedding.table)
    planned = random_ids(15, 5)
    want, want_hits = chunked_forwards(model, planned)
    compiled = torch.compile(model, fullgraph=True)
    got, hits = chunked_forwards(compiled, planned)
    for rows, expected in zip(got, want):
        assert_same_bits(rows, expected)
    assert hits == want_hits == 5
    model.embedding.lookahead(planned, CHUNK)
    with torch.no_grad():
        compiled(random_ids(16, 1))
    assert not model.embedding.looking_ahead and embedding.table.prefetched_bytes() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_a_captured_graph_replayed_per_chunk_reads_ahead(embedding):
    """The layer's forward captured once in a CUDA graph (a static ids
    buffer) and replayed for each chunk: the plan advances on the replays'
    gathers, with the bits and the hits of the eager forwards."""
    layer = embedding
    planned = random_ids(17, 6)
    layer.table.reset_stats()
    layer.lookahead(planned, CHUNK)
    want = [layer(chunk.cuda()) for chunk in planned.split(CHUNK, dim=-1)]
    torch.cuda.synchronize()
    want_hits = layer.table.stats()["prefetch_hits"]
    static_ids = torch.zeros((1, CHUNK), dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_ids)  # the first call on a device sets up its buffers
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_rows = layer(static_ids)
    layer.table.reset_stats()
    layer.lookahead(planned, CHUNK)
    got = []
    for chunk in planned.split(CHUNK, dim=-1):
        static_ids.copy_(chunk)
        graph.replay()
        got.append(static_rows.clone())
    torch.cuda.synchronize()
    for rows, expected in zip(got, want):
        assert_same_bits_but_nan(rows, expected)
    assert layer.table.stats()["prefetch_hits"] == want_hits == 6
    assert not layer.looking_ahead and layer.table.prefetched_bytes() == 0


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_a_model_compiled_with_fullgraph_and_cuda_graphs_reads_ahead(embedding):
    """mode="reduce-overhead": torch.compile captures the forward in CUDA
    graphs and replays them per chunk, with the eager bits and hits."""
    torch.manual_seed(0)
    model = TinyModel(embedding.table).cuda()
    planned = random_ids(18, 6)
    want, want_hits = chunked_forwards(model, planned, "cuda")
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, then replays
        chunked_forwards(compiled, planned, "cuda")
    got, hits = chunked_forwards(compiled, planned, "cuda")
    for rows, expected in zip(got, want):
        assert_same_bits_but_nan(rows, expected)
    assert hits == want_hits == 6


# A plan whose layer is gone gives back what it holds.

def test_layers_collected_mid_plan_give_back_their_rows_and_pins(tmp_path):
    """Eight layers over one table (kept open), each mid-plan with its rows
    read ahead pinned in the row cache: collecting them drops every
    prefetch and every pin, and the table serves on."""
    path = write_fp8_table(tmp_path / "t.safetensors", ROWS)
    with Table.from_safetensors(path, config=GatherConfig(row_cache_mib=1)) as table:
        layers = [DiskEmbedding(table) for _ in range(8)]
        for seed, layer in enumerate(layers):
            planned = random_ids(20 + seed, 4)
            layer.lookahead(planned, CHUNK, max_bytes=2 * CHUNK * table.row_bytes)
            layer(planned[:, :CHUNK])
        assert table.prefetched_bytes() == 8 * 2 * CHUNK * table.row_bytes
        deadline = time.monotonic() + 30
        while native.row_cache_pinned_rows(table._native) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the prefetch thread pins the rows as it reads them
        assert native.row_cache_pinned_rows(table._native) > 0
        del layers, layer
        gc.collect()
        assert table.prefetched_bytes() == 0
        assert native.row_cache_pinned_rows(table._native) == 0
        ids = random_ids(30, 1)
        assert_same_bits(DiskEmbedding(table)(ids), ple.gather(table, ids))


def test_a_copy_of_a_layer_is_another_owner(embedding):
    """A copy's gathers are its own: they neither advance nor end the
    original's plan."""
    table = embedding.table
    twin = copy.copy(embedding)
    assert twin.prefetch_owner != embedding.prefetch_owner and twin.table is table
    planned = random_ids(31, 3)
    embedding.lookahead(planned, CHUNK)
    twin(random_ids(32, 1))
    assert embedding.looking_ahead
    table.reset_stats()
    for chunk in planned.split(CHUNK, dim=-1):
        embedding(chunk)
    assert table.stats()["prefetch_hits"] == 3


def test_the_three_layers_answer_which_rows_with_one_signature(tmp_path):
    """row_ids, prefetch and lookahead take the same arguments on the three
    layers; row_ids is what the forward gathers, and the plan of a prompt's
    row ids serves each chunk's forward."""
    import inspect

    from test_friendly_errors import open_layers

    layers = open_layers(tmp_path)
    for method in ("row_ids", "prefetch", "lookahead"):
        signatures = {str(inspect.signature(getattr(type(layer), method)))
                      for layer in layers.values()}
        assert len(signatures) == 1, (method, signatures)
    tokens = prompt(40) % 60  # in every table
    for name, layer in layers.items():
        with layer.table:
            ids = layer.row_ids(tokens)
            assert ids.dtype == torch.int64 and ids.shape[0] == len(tokens), name
            rows = torch.ops.ple.disk_gather(ids, layer.table.handle, torch.float32)
            assert_same_bits(layer(tokens), rows.reshape(len(tokens), -1))
            layer.table.reset_stats()
            layer.lookahead(ids, 5)
            for chunk, context in chunks_of(tokens, 5):
                if isinstance(layer, NGramEmbedding):
                    layer(chunk, torch.zeros(len(chunk), dtype=torch.int64), context)
                else:
                    layer(chunk)
            assert layer.table.stats()["prefetch_hits"] == 5, name


def test_the_bound_is_the_native_queues():
    assert MOST_BYTES == native.MAX_PENDING_BYTES == 256 << 20


@pytest.mark.parametrize("mib", [0, 64, 256])
def test_a_bound_in_mib(mib):
    assert lookahead_mib(mib, "lookahead_mib") == mib


@pytest.mark.parametrize("bad", [-1, 257, 1.5, True, None, "8"])
def test_a_bad_bound_in_mib_names_where_it_was_set(bad):
    with pytest.raises(ValueError) as raised:
        lookahead_mib(bad, "lookahead_mib")
    assert str(raised.value) == (f"ple: lookahead_mib must be MiB of rows read ahead, an "
                                 f"integer in [0, 256] (0: no lookahead), not {bad!r}")


@pytest.mark.parametrize("text, read", [("lots", None), ("257", 257), ("-1", -1)])
def test_a_bad_bound_names_the_value_as_given(text, read):
    """A variable's text, read by its caller: the message quotes the text."""
    with pytest.raises(ValueError) as raised:
        lookahead_mib(read, "PLE_LOOKAHEAD_MIB", given=text)
    assert str(raised.value).endswith(f"(0: no lookahead), not {text!r}")
