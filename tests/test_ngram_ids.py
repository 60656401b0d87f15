"""ple.layers.ngram_ids: row_ids against transformers' own Qwen4Exp n-gram module
(the reference model, prefill and decode with its cache), against an independent
pure-Python transcription of the rules (a per-token loop over explicit history),
the reference checkpoint's known values, torch.compile, CUDA, CUDA graphs, and
argument checks."""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch._dynamo.utils
from hypothesis import given, settings
from hypothesis import strategies as st

from ple.layers.ngram_ids import (NGramHashing, is_prime, next_prime, ple_layer_index,
                                  splitmix64)

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


def ref_layout(h: dict):
    """(multipliers, head sizes, head offsets) of a hashing given as keyword arguments."""
    half = max(1, ((2**63 - 1) // h["vocab_size"]) // 2)
    seed = h["seed"] + 10007 * h["ple_layer_index"]
    multipliers = [2 * (ref_splitmix64((seed + 0x9E3779B97F4A7C15 * (i + 1)) % U64) % half) + 1
                   for i in range(h["ngram_size"])]
    heads = (h["ngram_size"] - 1) * h["heads_per_ngram"]
    primes, candidate = [], h["base_size"]
    while len(primes) < (h["ple_layer_index"] + 1) * heads:
        if ref_is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    sizes = primes[h["ple_layer_index"] * heads:]
    offsets = [h["row_offset"] + sum(sizes[:i]) for i in range(heads)]
    return multipliers, sizes, offsets


def ref_row_ids(h: dict, requests: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    """One row list per token, requests in order; each request is (tokens, context)."""
    m, sizes, offsets = ref_layout(h)
    eos, n = h["eos_id"], h["ngram_size"]
    out = []
    for tokens, context in requests:
        history = list(context) + list(tokens)
        for p in range(len(context), len(history)):
            shifts = [history[p]]
            for s in range(1, n):
                between = history[p - s:p]  # the token s back and those after it
                shifts.append(eos if eos in between else history[p - s])
            heads = []
            for gram in range(2, n + 1):
                mixed = 0
                for j in range(gram):
                    mixed = wrap64(mixed ^ wrap64(shifts[j] * m[j]))
                heads += [mixed] * h["heads_per_ngram"]
            out.append([mixed % size + offset for mixed, size, offset in zip(heads, sizes, offsets)])
    return out


def as_batch(requests, with_seq_ids: bool, with_context: bool):
    """(token_ids, seq_ids, context) tensors of requests; request i is context row i."""
    tokens = [t for request_tokens, _ in requests for t in request_tokens]
    seq = [i for i, (request_tokens, _) in enumerate(requests) for _ in request_tokens]
    width = len(requests[0][1])
    return (torch.tensor(tokens, dtype=torch.int64).reshape(-1),
            torch.tensor(seq, dtype=torch.int64).reshape(-1) if with_seq_ids else None,
            torch.tensor([c for _, c in requests], dtype=torch.int64).reshape(-1, width)
            if with_context else None)


# ---- strategies ------------------------------------------------------------------


@st.composite
def hashings(draw, vocab_sizes=st.sampled_from([1, 2, 7, 50, 262_144, 10**9])):
    vocab_size = draw(vocab_sizes)
    return dict(vocab_size=vocab_size, eos_id=draw(st.integers(0, vocab_size - 1)),
                ple_layer_index=draw(st.integers(0, 3)), seed=draw(st.sampled_from([1234, 0, 2**64 - 1])),
                base_size=draw(st.sampled_from([1, 2, 96, 97, 2_500_000])),
                ngram_size=draw(st.integers(2, 5)), heads_per_ngram=draw(st.integers(1, 3)),
                row_offset=draw(st.sampled_from([0, 5, 320_001_536])))


@st.composite
def batches(draw, hashing, tokens=None):
    """requests, with_seq_ids, with_context; tokens are EOS-heavy, contexts may hold EOS."""
    eos = hashing["eos_id"]
    if tokens is None:
        tokens = st.one_of(st.just(eos), st.integers(0, hashing["vocab_size"] - 1))
    with_seq_ids = draw(st.booleans())
    with_context = draw(st.booleans())
    num_requests = draw(st.integers(1, 4)) if with_seq_ids else 1
    width = hashing["ngram_size"] - 1
    requests = []
    for _ in range(num_requests):
        # An empty request has a context row but no tokens in this batch.
        request_tokens = draw(st.lists(tokens, max_size=8))
        context = draw(st.lists(tokens, min_size=width, max_size=width)) if with_context else [eos] * width
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


# ---- row ids against the transcription ---------------------------------------------


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


DEFAULT = dict(vocab_size=262_144, eos_id=1, ple_layer_index=3, base_size=2_500_000)


def default_hashing(**changes) -> dict:
    return dict(DEFAULT, seed=1234, ngram_size=3, heads_per_ngram=8, row_offset=0) | changes


@pytest.mark.parametrize("requests", [
    [([], [1, 1])],
    [([7], [1, 1])],
    [([1], [1, 1])],
    [([1, 1, 1, 5, 1], [1, 1])],
    [([5, 6], [1, 9]), ([1, 8, 9, 1], [9, 1]), ([4], [0, 0]), ([2, 3], [1, 0])],
], ids=["T=0", "T=1", "T=1 EOS", "consecutive EOS, EOS context", "EOS at both ends, EOS contexts"])
def test_row_ids_edge_batches(requests):
    check(default_hashing(), requests, with_seq_ids=True, with_context=True)


def test_eos_resets_history():
    """Rows depend only on the tokens since the last EOS (3-gram heads too)."""
    layer = NGramHashing(**DEFAULT)
    ids = layer.row_ids(torch.tensor([11, 12, 1, 13, 14, 1, 13, 14]))
    after_eos = layer.row_ids(torch.tensor([1, 13, 14]))[1:]
    assert torch.equal(ids[3:5], after_eos) and torch.equal(ids[6:8], after_eos)
    assert torch.equal(layer.row_ids(torch.tensor([13]), context=torch.tensor([[12, 1]])), after_eos[:1])
    # A new request's missing history is EOS, so it hashes as if it followed one.
    assert torch.equal(layer.row_ids(torch.tensor([13, 14])), after_eos)


def test_int32_ids_give_the_same_rows():
    layer = NGramHashing(**DEFAULT)
    tokens = torch.tensor([5, 1, 9, 262_143, 0])
    seq_ids = torch.tensor([0, 0, 1, 1, 1])
    context = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(layer.row_ids(tokens.int(), seq_ids.int(), context.int()),
                       layer.row_ids(tokens, seq_ids, context))


# ---- row ids against the reference model ---------------------------------------------


def reference_configs(count: int, seed: int = 0):
    """Tiny random Qwen4Exp text configs with two PLE layers."""
    configs = pytest.importorskip("transformers.models.qwen4_exp.configuration_qwen4_exp")
    rng = random.Random(seed)
    for case in range(count):
        ngram_size = (2, 3, 4)[case % 3]
        heads_per_ngram = rng.randint(1, 8)
        yield configs.Qwen4ExpTextConfig(
            vocab_size=rng.choice([5, 30, 1000]), eos_token_id=rng.choice([0, 3, [2, 4]]),
            ple_layer_ids=[3, 1], num_hidden_layers=4, hidden_size=16,
            ple_embed_dim=(ngram_size - 1) * heads_per_ngram * 2, ngram_size=ngram_size,
            heads_per_ngram=heads_per_ngram, ngram_vocab_size_base=rng.choice([97, 100, 1009, 1200]),
            make_ngram_vocab_size_divisible_by=rng.choice([1, 128]), seed=rng.choice([1234, 0, 77]),
            num_experts=2, num_experts_per_tok=1)


def reference_steps(config, layer: int, steps: list[torch.Tensor]) -> list[torch.Tensor]:
    """The ids transformers' n-gram module of PLE layer ``layer`` passes to its
    table, for each step ``[B, L]`` of a generation with its cache."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    decoder_layer = sorted(config.ple_layer_ids)[layer] - 1
    module = Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, decoder_layer, layer)
    seen = []
    module.ngram_embedding.register_forward_hook(lambda _, args, __: seen.append(args[0]))
    cache = transformers.DynamicCache(config=config)
    for step in steps:
        module(step, cache)
    return seen


@pytest.mark.parametrize("case", range(24))
def test_row_ids_equal_the_reference_models_prefill_and_decode(case):
    """Several requests through a prefill, decode steps and a chunk: ple's ids
    with each request's context equal the module's with its cache."""
    config = list(reference_configs(24))[case]
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    rng = random.Random(case)
    token = lambda: eos if rng.random() < 0.3 else rng.randrange(config.vocab_size)  # noqa: E731
    batch = rng.randint(1, 3)
    lengths = [rng.randint(1, 9), 1, 1, 3, 1]  # the first may be shorter than the context
    steps = [torch.tensor([[token() for _ in range(n)] for _ in range(batch)]) for n in lengths]
    width = config.ngram_size - 1
    for layer in (0, 1):
        hashing = NGramHashing.from_config(config, ple_layer_index=layer)
        expected = reference_steps(config, layer, steps)
        history = [[eos] * width for _ in range(batch)]
        for step, reference in zip(steps, expected):
            context = torch.tensor([h[-width:] for h in history])
            seq_ids = torch.arange(batch).repeat_interleave(step.shape[1])
            ids = hashing.row_ids(step.reshape(-1), seq_ids, context)
            assert torch.equal(ids, reference.reshape(ids.shape)), (case, layer)
            for h, tokens in zip(history, step.tolist()):
                h.extend(tokens)
        # One new request without context is the prefill of a batch of one.
        assert torch.equal(hashing.row_ids(steps[0][0]), reference_steps(config, layer, steps[:1])[0][0])


def test_known_values_of_the_released_model():
    config = dict(vocab_size=248_320, eos_token_id=248_044, ple_layer_ids=[2], ngram_size=3,
                  heads_per_ngram=8, ngram_vocab_size_base=20_000_000, seed=1234)
    hashing = NGramHashing.from_config(config)
    assert hashing.multipliers == (23703573157769, 20109073645365, 8052911324071)
    assert hashing.head_sizes[0] == 20_000_003 and hashing.head_sizes[-1] == 20_000_171
    assert len(hashing.head_sizes) == 16 and all(is_prime(size) for size in hashing.head_sizes)
    assert hashing.rows == 320_001_446 and hashing.padded_rows(128) == 320_001_536
    assert -(-hashing.padded_rows(128) // 128) == 2_500_012
    assert hashing.row_ids(torch.tensor([1000, 248044, 2000, 3000, 4000]))[0, 0] == 1876085
    assert ple_layer_index(config, 1) == 0


# ---- layout ----------------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 1, 4])
@pytest.mark.parametrize("ngram_size", [2, 3, 4])
def test_layout_matches_transcription(layer, ngram_size):
    hashing = default_hashing(ple_layer_index=layer, row_offset=1000, ngram_size=ngram_size,
                              heads_per_ngram=3, base_size=2_500_000)
    layout = NGramHashing(**hashing)
    multipliers, sizes, offsets = ref_layout(hashing)
    assert list(layout.multipliers) == multipliers
    assert all(m % 2 == 1 and m < 2**63 for m in layout.multipliers)
    assert list(layout.head_sizes) == sizes and list(layout.head_offsets) == offsets
    assert layout.rows == sum(sizes) and layout.heads == (ngram_size - 1) * 3


def test_head_sizes_continue_one_prime_sequence_across_layers():
    first, second = (NGramHashing(**default_hashing(ple_layer_index=i, base_size=97)) for i in (0, 1))
    assert first.head_sizes[0] == 97  # the smallest prime >= the base
    assert next_prime(first.head_sizes[-1]) == second.head_sizes[0]


def test_layers_hash_differently():
    assert len({NGramHashing(**DEFAULT | {"ple_layer_index": i}).multipliers for i in range(8)}) == 8


def test_constants_replace_the_derived_values():
    derived = NGramHashing(**default_hashing(heads_per_ngram=1, base_size=10, ple_layer_index=0))
    constants = {"layer_multipliers": [3, 5, 7], "ngram_heads_vocab_sizes": [11, 13],
                 "ngram_heads_offsets": [0, 11]}
    hashing = NGramHashing(**default_hashing(heads_per_ngram=1, base_size=10, ple_layer_index=0, row_offset=4),
                           constants=constants)
    assert hashing.multipliers == (3, 5, 7) and hashing.head_sizes == (11, 13)
    assert hashing.head_offsets == (4, 15) and hashing.rows == 24
    assert derived.head_sizes == (11, 13) and derived.multipliers != (3, 5, 7)
    tokens = torch.tensor([2, 9, 1, 6])
    m = hashing.multipliers
    mixed2 = (tokens * m[0]) ^ (torch.tensor([1, 2, 9, 1]) * m[1])
    assert torch.equal(hashing.row_ids(tokens)[:, 0], mixed2 % 11 + 4)
    only_sizes = NGramHashing(**default_hashing(heads_per_ngram=1, base_size=10, ple_layer_index=0),
                              constants={"head_vocab_sizes": [5, 9]})
    assert only_sizes.head_offsets == (0, 5) and only_sizes.multipliers == derived.multipliers


def test_from_config_reads_a_dict_or_a_composite_config():
    keys = dict(vocab_size=1000, eos_token_id=[9, 3], ple_layer_ids=[4, 2], ngram_size=4,
                heads_per_ngram=2, ngram_vocab_size_base=500, seed=5)
    hashing = NGramHashing.from_config({"text_config": keys}, ple_layer_index=1, row_offset=7)
    assert hashing == NGramHashing(1000, 9, base_size=500, ple_layer_index=1, ngram_size=4,
                                   heads_per_ngram=2, seed=5, row_offset=7)
    assert ple_layer_index(keys, 3) == 1
    with pytest.raises(ValueError, match=r"^decoder layer 0 has no PLE \(ple_layer_ids are the 1-based "
                                         r"layers \[2, 4\]\)$"):
        ple_layer_index(keys, 0)
    with pytest.raises(ValueError, match=r"^ple_layer_index must be in \[0, 2\) for this config's 2 "
                                         r"PLE layers, got 2$"):
        NGramHashing.from_config(keys, ple_layer_index=2)
    with pytest.raises(KeyError, match="the model config has no 'ngram_size'"):
        NGramHashing.from_config({k: v for k, v in keys.items() if k != "ngram_size"})


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
    ({"ple_layer_index": -1}, "ple_layer_index must be >= 0, got -1"),
    ({"base_size": 0}, "base_size must be >= 1, got 0"),
    ({"ngram_size": 1}, "ngram_size must be >= 2, got 1"),
    ({"heads_per_ngram": 0}, "heads_per_ngram must be >= 1, got 0"),
    ({"row_offset": -5}, "row_offset must be >= 0, got -5"),
    ({"row_offset": 2**63 - 10, "base_size": 10, "heads_per_ngram": 1, "ngram_size": 2, "ple_layer_index": 0},
     f"the layer's last row {2**63} does not fit in int64"),
    ({"constants": {"layer_multipliers": [1, 3]}},
     "layer_multipliers has 2 entries, but a layer of ngram_size 3 and 8 heads per n-gram needs 3"),
    ({"constants": {"head_offsets": [0] * 15}},
     "head_offsets has 15 entries, but a layer of ngram_size 3 and 8 heads per n-gram needs 16"),
    ({"constants": {"shard_rows": [1]}}, "unknown n-gram constant 'shard_rows'"),
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
     "context must be [R, 2] (ngram_size - 1 tokens, oldest first) on token_ids' device (cpu), "
     "got (1, 3) on cpu"),
    ((torch.zeros(3, dtype=torch.long), None, torch.zeros(2, 2, dtype=torch.long)),
     "without seq_ids the batch is one request, so context must be [1, 2], got (2, 2)"),
])
def test_bad_row_id_arguments(args, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        NGramHashing(**DEFAULT).row_ids(*args)
