"""ple.layers.ngram_ids: row_ids against an independent pure-Python transcription
of design.md §3 (Python ints, a per-token loop with explicit history), the layer's
multipliers and head layout, torch.compile, CUDA, CUDA graphs, argument checks."""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch._dynamo.utils
from hypothesis import given, settings
from hypothesis import strategies as st

from ple.layers.ngram_ids import NGramHashing, is_prime, next_prime, splitmix64

# ---- the transcription ------------------------------------------------------------

U64 = 1 << 64


def ref_splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) % U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % U64
    return z ^ (z >> 31)


def ref_is_prime(n: int) -> bool:
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def wrap64(x: int) -> int:
    """x as a two's-complement int64."""
    x %= U64
    return x - U64 if x >= 1 << 63 else x


def ref_layout(vocab_size, layer_id, seed, base_size, bigram_heads, trigram_heads, row_offset):
    half = ((2**63 - 1) // vocab_size) // 2
    multipliers = [2 * (ref_splitmix64((seed + 10007 * layer_id + 0x9E3779B97F4A7C15 * (i + 1)) % U64) % half) + 1
                   for i in range(3)]
    sizes, offsets = [], []
    candidate, offset = base_size, row_offset
    for _ in range(bigram_heads + trigram_heads):
        candidate += 1
        while not ref_is_prime(candidate):
            candidate += 1
        sizes.append(candidate)
        offsets.append(offset)
        offset += candidate
    return multipliers, sizes, offsets


def ref_row_ids(hashing: dict, requests: list[tuple[list[int], tuple[int, int]]]) -> list[list[int]]:
    """One row list per token, requests in order; each request is (tokens, (prev2, prev))."""
    m, sizes, offsets = ref_layout(hashing["vocab_size"], hashing["layer_id"], hashing["seed"],
                                   hashing["base_size"], hashing["bigram_heads"],
                                   hashing["trigram_heads"], hashing["row_offset"])
    pad, eos = hashing["pad_id"], hashing["eos_id"]
    out = []
    for tokens, (context_prev2, context_prev) in requests:
        # The state is what the next token sees as (prev2, prev), EOS already applied.
        if context_prev == eos:
            state = (pad, pad)
        elif context_prev2 == eos:
            state = (pad, context_prev)
        else:
            state = (context_prev2, context_prev)
        for cur in tokens:
            prev2, prev = state
            mixed2 = wrap64(wrap64(cur * m[0]) ^ wrap64(prev * m[1]))
            mixed3 = wrap64(mixed2 ^ wrap64(prev2 * m[2]))
            heads = [mixed2] * hashing["bigram_heads"] + [mixed3] * hashing["trigram_heads"]
            out.append([mixed % size + offset for mixed, size, offset in zip(heads, sizes, offsets)])
            state = (pad, pad) if cur == eos else (prev, cur)
    return out


def as_batch(requests, with_seq_ids: bool, with_context: bool):
    """(token_ids, seq_ids, context) tensors of requests; request i is context row i."""
    tokens = [t for request_tokens, _ in requests for t in request_tokens]
    seq = [i for i, (request_tokens, _) in enumerate(requests) for _ in request_tokens]
    return (torch.tensor(tokens, dtype=torch.int64).reshape(-1),
            torch.tensor(seq, dtype=torch.int64).reshape(-1) if with_seq_ids else None,
            torch.tensor([c for _, c in requests], dtype=torch.int64).reshape(-1, 2) if with_context else None)


# ---- strategies ------------------------------------------------------------------


@st.composite
def hashings(draw, vocab_sizes=st.sampled_from([1, 2, 7, 50, 262_144, 10**9])):
    vocab_size = draw(vocab_sizes)
    token = st.integers(0, vocab_size - 1)
    bigram_heads = draw(st.integers(0, 3))
    trigram_heads = draw(st.integers(0 if bigram_heads else 1, 3))
    return dict(vocab_size=vocab_size, eos_id=draw(token), pad_id=draw(token),
                layer_id=draw(st.integers(0, 60)), seed=draw(st.sampled_from([1234, 0, 2**64 - 1])),
                base_size=draw(st.sampled_from([1, 2, 96, 2_500_000])),
                bigram_heads=bigram_heads, trigram_heads=trigram_heads,
                row_offset=draw(st.sampled_from([0, 5, 320_001_536])))


@st.composite
def batches(draw, hashing, tokens=None):
    """requests, with_seq_ids, with_context; tokens are EOS-heavy, contexts may hold EOS."""
    if tokens is None:
        tokens = st.one_of(st.just(hashing["eos_id"]), st.just(hashing["pad_id"]),
                           st.integers(0, hashing["vocab_size"] - 1))
    with_seq_ids = draw(st.booleans())
    with_context = draw(st.booleans())
    num_requests = draw(st.integers(1, 4)) if with_seq_ids else 1
    pad = hashing["pad_id"]
    requests = []
    for _ in range(num_requests):
        # An empty request has a context row but no tokens in this batch.
        request_tokens = draw(st.lists(tokens, max_size=8))
        context = (draw(tokens), draw(tokens)) if with_context else (pad, pad)
        requests.append((request_tokens, context))
    return requests, with_seq_ids, with_context


def check(hashing: dict, requests, with_seq_ids, with_context):
    layer = NGramHashing(**hashing)
    ids = layer.row_ids(*as_batch(requests, with_seq_ids, with_context))
    expected = ref_row_ids(hashing, requests)
    assert ids.dtype == torch.int64
    assert ids.shape == (len(expected), layer.heads)
    assert ids.tolist() == expected
    if ids.numel():
        assert layer.row_offset <= ids.min().item() and ids.max().item() < layer.row_offset + layer.rows


# ---- row ids ---------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_row_ids_match_transcription(data):
    hashing = data.draw(hashings())
    check(hashing, *data.draw(batches(hashing)))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_row_ids_wrap_like_int64_for_any_token(data):
    """Out-of-vocabulary ids overflow token * m_i; the hash still wraps in int64."""
    hashing = data.draw(hashings())
    any_int64 = st.integers(-(2**63), 2**63 - 1)
    check(hashing, *data.draw(batches(hashing, st.one_of(st.just(hashing["eos_id"]), any_int64))))


DEFAULT = dict(vocab_size=262_144, eos_id=1, layer_id=3, base_size=2_500_000)


def default_hashing(**changes) -> dict:
    return dict(DEFAULT, seed=1234, bigram_heads=8, trigram_heads=8, pad_id=0, row_offset=0) | changes


@pytest.mark.parametrize("requests", [
    [([], (0, 0))],
    [([7], (0, 0))],
    [([1], (0, 0))],
    [([1, 1, 1, 5, 1], (1, 1))],
    [([5, 6], (1, 9)), ([1, 8, 9, 1], (9, 1)), ([4], (0, 0)), ([2, 3], (1, 0))],
], ids=["T=0", "T=1", "T=1 EOS", "consecutive EOS, EOS context", "EOS at both ends, EOS contexts"])
def test_row_ids_edge_batches(requests):
    check(default_hashing(), requests, with_seq_ids=True, with_context=True)


def test_eos_resets_history():
    """Rows depend only on the tokens since the last EOS (trigram heads too)."""
    layer = NGramHashing(**DEFAULT)
    ids = layer.row_ids(torch.tensor([11, 12, 1, 13, 14, 1, 13, 14]))
    fresh = layer.row_ids(torch.tensor([13, 14]))
    assert torch.equal(ids[3:5], fresh) and torch.equal(ids[6:8], fresh)
    assert torch.equal(layer.row_ids(torch.tensor([13]), context=torch.tensor([[12, 1]])), fresh[:1])


def test_int32_ids_give_the_same_rows():
    layer = NGramHashing(**DEFAULT)
    tokens = torch.tensor([5, 1, 9, 262_143, 0])
    seq_ids = torch.tensor([0, 0, 1, 1, 1])
    context = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(layer.row_ids(tokens.int(), seq_ids.int(), context.int()),
                       layer.row_ids(tokens, seq_ids, context))


# ---- layout ----------------------------------------------------------------------


@pytest.mark.parametrize("layer_id", [0, 1, 14, 61])
def test_layout_matches_transcription(layer_id):
    hashing = default_hashing(layer_id=layer_id, row_offset=1000)
    layer = NGramHashing(**hashing)
    multipliers, sizes, offsets = ref_layout(*(hashing[k] for k in (
        "vocab_size", "layer_id", "seed", "base_size", "bigram_heads", "trigram_heads", "row_offset")))
    assert list(layer.multipliers) == multipliers
    assert all(m % 2 == 1 and m < 2**63 for m in layer.multipliers)
    assert list(layer.head_sizes) == sizes and list(layer.head_offsets) == offsets
    assert layer.rows == sum(sizes) and layer.heads == 16


def test_layers_hash_differently():
    assert len({NGramHashing(**DEFAULT | {"layer_id": i}).multipliers for i in range(8)}) == 8


def test_splitmix64_known_outputs():
    # The first two outputs of the reference SplitMix64 generator seeded with 0.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    rng = random.Random(0)
    for x in [rng.getrandbits(64) for _ in range(50)] + [2**64 - 1, 2**64, -1]:
        assert splitmix64(x) == ref_splitmix64(x % U64)


def test_primality():
    assert [n for n in range(5000) if is_prime(n)] == [n for n in range(5000) if ref_is_prime(n)]
    # Carmichael numbers and strong pseudoprimes to the first few bases.
    for composite in (561, 2047, 1373653, 3215031751, 3825123056546413051, (2**31 - 1) * (2**61 - 1)):
        assert not is_prime(composite)
    assert is_prime(2**61 - 1) and is_prime(2**64 - 59)
    assert next_prime(10**10) == 10**10 + 19 and ref_is_prime(10**10 + 19)
    assert next_prime(0) == 2 and next_prime(2) == 3


# ---- compile and devices -----------------------------------------------------------


def random_batch(seed: int, num_tokens: int = 64):
    """A batch of DEFAULT's vocabulary: five requests of which request 2 is
    empty, EOS-heavy tokens and contexts."""
    rng = random.Random(seed)
    eos_id, vocab_size = DEFAULT["eos_id"], DEFAULT["vocab_size"]
    token = lambda: eos_id if rng.random() < 0.15 else rng.randrange(vocab_size)  # noqa: E731
    tokens = torch.tensor([token() for _ in range(num_tokens)])
    seq_ids = torch.tensor(sorted(rng.choice([0, 1, 3, 4]) for _ in range(num_tokens)))
    context = torch.tensor([[token(), token()] for _ in range(5)])
    return tokens, seq_ids, context


@pytest.mark.slow
def test_compile_fullgraph_cpu():
    """One small case: Inductor's C++ build takes 5 to 20 s on 2 cores."""
    layer = NGramHashing(**DEFAULT)
    batch = random_batch(1, num_tokens=16)
    compiled = torch.compile(layer.row_ids, fullgraph=True)
    assert torch.equal(compiled(*batch), layer.row_ids(*batch))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_matches_cpu():
    layer = NGramHashing(**DEFAULT)
    for seed, num_tokens in ((0, 0), (1, 1), (2, 4096)):
        batch = random_batch(seed, num_tokens)
        on_gpu = layer.row_ids(*(t.cuda() for t in batch))
        assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), layer.row_ids(*batch))
    wild = torch.tensor([-(2**63), 2**63 - 1, -1, 12345678901234567])
    assert torch.equal(layer.row_ids(wild.cuda()).cpu(), layer.row_ids(wild))


@cuda
def test_cuda_compile_fullgraph_cudagraphs():
    """mode="reduce-overhead" records a CUDA graph (no skip) and replays it right."""
    torch._dynamo.utils.counters.clear()
    layer = NGramHashing(**DEFAULT)
    compiled = torch.compile(layer.row_ids, fullgraph=True, mode="reduce-overhead")
    for seed in range(4):  # warm-up, record, then replays
        batch = random_batch(seed, 256)
        assert torch.equal(compiled(*(t.cuda() for t in batch)).cpu(), layer.row_ids(*batch))
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


@cuda
def test_cuda_graph_capture_before_first_call_says_why():
    layer = NGramHashing(**DEFAULT)
    tokens = torch.zeros(8, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="call row_ids once on cuda:0 before capturing a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layer.row_ids(tokens)


@cuda
def test_cuda_graph_capture():
    layer = NGramHashing(**DEFAULT)
    static = [t.cuda() for t in random_batch(4, 512)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.row_ids(*static)  # warm-up: builds the cached head tensors outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer.row_ids(*static)
    for seed in (5, 6):
        batch = random_batch(seed, 512)
        for destination, source in zip(static, batch):
            destination.copy_(source)
        graph.replay()
        assert torch.equal(captured.cpu(), layer.row_ids(*batch))


# ---- argument checks -------------------------------------------------------------


@pytest.mark.parametrize("changes, message", [
    ({"vocab_size": 0}, "vocab_size must be in [1, 2**62 - 1], got 0"),
    ({"vocab_size": 2**62}, f"vocab_size must be in [1, 2**62 - 1], got {2**62}"),
    ({"eos_id": 262_144}, "eos_id must be in [0, vocab_size=262144), got 262144"),
    ({"eos_id": -1}, "eos_id must be in [0, vocab_size=262144), got -1"),
    ({"pad_id": 262_144}, "pad_id must be in [0, vocab_size=262144), got 262144"),
    ({"layer_id": -1}, "layer_id must be >= 0, got -1"),
    ({"base_size": 0}, "base_size must be >= 1, got 0"),
    ({"bigram_heads": -1}, "bigram_heads and trigram_heads must be >= 0, got -1 and 8"),
    ({"bigram_heads": 0, "trigram_heads": 0},
     "a layer needs at least one head, got bigram_heads=0 and trigram_heads=0"),
    ({"row_offset": -5}, "row_offset must be >= 0, got -5"),
    ({"row_offset": 2**63 - 10, "base_size": 10, "bigram_heads": 1, "trigram_heads": 0},
     f"the layer's last row {2**63} does not fit in int64"),
])
def test_bad_arguments(changes, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        NGramHashing(**DEFAULT | changes)


def test_non_int_argument():
    with pytest.raises(TypeError, match=r"^vocab_size must be an int, got float$"):
        NGramHashing(**DEFAULT | {"vocab_size": 1e5})


@pytest.mark.parametrize("args, message", [
    ((torch.zeros(2, 3, dtype=torch.long),), "token_ids must be 1-D [T], got shape (2, 3)"),
    ((torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long)),
     "seq_ids must be [T] on token_ids' device ((3,), cpu), got (2,) on cpu"),
    ((torch.zeros(3, dtype=torch.long), None, torch.zeros(1, 3, dtype=torch.long)),
     "context must be [R, 2] on token_ids' device (cpu), got (1, 3) on cpu"),
    ((torch.zeros(3, dtype=torch.long), None, torch.zeros(2, 2, dtype=torch.long)),
     "without seq_ids the batch is one request, so context must be [1, 2], got (2, 2)"),
])
def test_bad_row_id_arguments(args, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        NGramHashing(**DEFAULT).row_ids(*args)
