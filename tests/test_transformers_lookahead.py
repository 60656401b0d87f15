"""Lookahead in the transformers integration: ``generate(...,
prefill_chunk_size=N)`` of tiny random Qwen4Exp and Gemma 3n models served
by ple gives the tokens and logits of transformers' own model and of ple
without lookahead, bit for bit, for chunks of one token, a partial last
chunk and one chunk, two requests with an EOS inside; each chunk after the
first is a prefetch hit, with direct I/O and a row cache too; nothing is
read ahead after generate returns or raises; on CUDA too (skipped without a
GPU).

Batches of three padded requests (left, right, a mask with a hole), given
with their attention mask: the plan foresees the ids each model gathers
(Qwen4Exp hashes the masked tokens as EOS, except in a chunk of one token),
so every chunk is a hit, with the bits of transformers' own model."""

from __future__ import annotations

import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")

from helpers import assert_same_bits, quiet_transformers  # noqa: E402, F401 (an autouse fixture)
from ple import GatherConfig  # noqa: E402
from ple.integrations.transformers import from_pretrained, tables  # noqa: E402
from ple.layers import DiskEmbedding  # noqa: E402
from test_transformers_integration import MODELS, checkpoints, prompt  # noqa: E402, F401 (fixture)

PROMPT_SHAPE = (2, 10)


def generate(model, ids, chunk_size, **kwargs):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, prefill_chunk_size=chunk_size,
                             return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def served_modules(model) -> list[DiskEmbedding]:
    return [m for m in model.modules() if isinstance(m, DiskEmbedding)]


@pytest.mark.parametrize("key", MODELS)
@pytest.mark.parametrize("chunk_size", [1, 3, 10])
def test_generate_with_lookahead_equals_transformers(checkpoints, key, chunk_size):
    model_class = MODELS[key][0]
    reference = model_class.from_pretrained(checkpoints[key])
    served = from_pretrained(model_class, checkpoints[key])
    without = from_pretrained(model_class, checkpoints[key], lookahead_mib=0)
    ids = prompt(1, PROMPT_SHAPE)
    want_tokens, want_logits = generate(reference, ids, chunk_size)
    for model in (without, served):
        for table in tables(model).values():
            table.reset_stats()
        tokens, logits = generate(model, ids, chunk_size)
        assert torch.equal(tokens, want_tokens)
        assert_same_bits(logits, want_logits)
    chunks = -(-PROMPT_SHAPE[1] // chunk_size)
    for name, table in tables(served).items():
        # One chunk has nothing to overlap: its forward reads its own rows.
        assert table.stats()["prefetch_hits"] == (chunks if chunks > 1 else 0), name
    assert all(table.stats()["prefetch_hits"] == 0 for table in tables(without).values())
    assert not any(module.looking_ahead for module in served_modules(served))


@pytest.mark.parametrize("key", MODELS)
def test_generate_with_lookahead_over_direct_io_and_a_row_cache(checkpoints, key):
    """The tables read with O_DIRECT into a row cache: every chunk a hit, its
    rows held pinned in the cache until taken, the bits of transformers'."""
    model_class = MODELS[key][0]
    reference = model_class.from_pretrained(checkpoints[key])
    config = GatherConfig(io="direct", threads=1, row_cache_mib=4)
    served = from_pretrained(model_class, checkpoints[key], gather_config=config)
    ids = prompt(3, PROMPT_SHAPE)
    want_tokens, want_logits = generate(reference, ids, 3)
    tokens, logits = generate(served, ids, 3)
    assert torch.equal(tokens, want_tokens)
    assert_same_bits(logits, want_logits)
    for name, table in tables(served).items():
        stats = table.stats()
        assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (4, 0), name
        assert stats["prefetch_pinned_rows"] > 0 and stats["direct_reads"] > 0, name
        assert table.prefetched_bytes() == 0, name


def test_nothing_is_read_ahead_after_generate_raises(checkpoints):
    model_class = MODELS["qwen4exp"][0]
    served = from_pretrained(model_class, checkpoints["qwen4exp"])
    module = served_modules(served)[0]
    forwards = []

    def fail_at_the_second_chunk(*_):
        forwards.append(1)
        if len(forwards) == 2:
            raise RuntimeError("a failure mid-prefill")

    hook = module.register_forward_pre_hook(fail_at_the_second_chunk)
    with pytest.raises(RuntimeError, match="a failure mid-prefill"):
        generate(served, prompt(2, PROMPT_SHAPE), 2)
    hook.remove()
    assert not any(m.looking_ahead for m in served_modules(served))
    assert all(t.prefetched_bytes() == 0 for t in tables(served).values())
    calls = {name: t.stats()["calls"] for name, t in tables(served).items()}
    time.sleep(0.2)  # a read left running would count here
    assert calls == {name: t.stats()["calls"] for name, t in tables(served).items()}


def test_ending_one_generates_plans_leaves_anothers(checkpoints):
    """Two generates on one model, on two threads: the second's plans replace
    the first's on every module, and the first's end, when it returns, ends
    its own plans alone; the second's go on looking ahead until its own end."""
    from ple.integrations.transformers import generate as prefill_lookahead

    served = from_pretrained(MODELS["qwen4exp"][0], checkpoints["qwen4exp"])
    modules = served_modules(served)
    first = prefill_lookahead.start(served, prompt(4, PROMPT_SHAPE), 2, 1 << 20)
    second = prefill_lookahead.start(served, prompt(5, PROMPT_SHAPE), 2, 1 << 20)
    assert [module for module, _ in first] == [module for module, _ in second] == modules
    held = {name: t.prefetched_bytes() for name, t in tables(served).items()}
    prefill_lookahead.end(first)
    assert all(module.looking_ahead for module in modules)
    assert held == {name: t.prefetched_bytes() for name, t in tables(served).items()}
    assert all(held.values())
    prefill_lookahead.end(second)
    assert not any(module.looking_ahead for module in modules)
    assert all(t.prefetched_bytes() == 0 for t in tables(served).values())


@pytest.mark.slow
def test_generate_of_a_model_compiled_with_fullgraph_looks_ahead(checkpoints):
    """Gemma 3n served by ple with its forward compiled with fullgraph=True
    (where a graph break is an error; transformers' own model generates so):
    a chunked prefill gives the tokens, logits and hits of the eager model.
    Dynamo's graph is what lookahead could break, so Inductor's code
    generation (minutes here) is left out: the backend runs the graph as
    captured."""
    served = from_pretrained(MODELS["gemma3n"][0], checkpoints["gemma3n"])
    ids = prompt(6, PROMPT_SHAPE)

    def chunked_generate():
        for table in tables(served).values():
            table.reset_stats()
        tokens, logits = generate(served, ids, 4)
        hits = {name: table.stats()["prefetch_hits"] for name, table in tables(served).items()}
        return tokens, logits, hits

    want_tokens, want_logits, want_hits = chunked_generate()
    served.forward = torch.compile(served.forward, fullgraph=True, backend="eager")
    tokens, logits, hits = chunked_generate()
    assert torch.equal(tokens, want_tokens)
    assert_same_bits(logits, want_logits)
    assert hits == want_hits == {name: 3 for name in tables(served)}
    assert not any(module.looking_ahead for module in served_modules(served))


PADDED_LENGTH = 10
PAD_ID = 0


def padded_batch(padding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Three requests of 10, 7 and 4 tokens (an EOS inside the first), padded
    to 10 on the left or the right, or unpadded with a hole of three masked
    tokens in the second; the ids and the attention mask."""
    ids = prompt(4, (3, PADDED_LENGTH))
    mask = torch.ones_like(ids)
    for row, length in enumerate((10, 7, 4)):
        pads = slice(0, PADDED_LENGTH - length) if padding == "left" else slice(length, None)
        if padding != "hole":
            mask[row, pads] = 0
    if padding == "hole":
        mask[1, 3:6] = 0
    return torch.where(mask.bool(), ids, PAD_ID), mask


@pytest.mark.parametrize("key", MODELS)
@pytest.mark.parametrize("padding, chunk_size",
                         [("left", 1), ("left", 3), ("left", 4), ("right", 3), ("hole", 4)])
def test_padded_batches_read_ahead_every_chunk(checkpoints, key, padding, chunk_size):
    """Chunks of 3 leave a last chunk of one token (hashed unmasked: a
    padding token, on the right), chunks of 1 only such chunks."""
    model_class = MODELS[key][0]
    reference = model_class.from_pretrained(checkpoints[key])
    served = from_pretrained(model_class, checkpoints[key])
    ids, mask = padded_batch(padding)
    want_tokens, want_logits = generate(reference, ids, chunk_size, attention_mask=mask,
                                        pad_token_id=PAD_ID)
    for table in tables(served).values():
        table.reset_stats()
    tokens, logits = generate(served, ids, chunk_size, attention_mask=mask, pad_token_id=PAD_ID)
    assert torch.equal(tokens, want_tokens)
    assert_same_bits(logits, want_logits)
    chunks = -(-PADDED_LENGTH // chunk_size)
    for name, table in tables(served).items():
        assert (table.stats()["prefetch_hits"], table.prefetched_bytes()) == (chunks, 0), name
    assert not any(module.looking_ahead for module in served_modules(served))


@pytest.mark.parametrize("bad", [-1, 257, 1.5])
def test_a_bad_lookahead_bound_is_refused(checkpoints, bad):
    with pytest.raises(ValueError, match=rf"^ple: lookahead_mib must be MiB of rows read ahead, an "
                                         rf"integer in \[0, 256\] \(0: no lookahead\), not {bad}$"):
        from_pretrained(MODELS["gemma3n"][0], checkpoints["gemma3n"], lookahead_mib=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("key", MODELS)
def test_cuda_generate_with_lookahead_equals_without(checkpoints, key):
    model_class = MODELS[key][0]
    served = from_pretrained(model_class, checkpoints[key]).to("cuda")
    without = from_pretrained(model_class, checkpoints[key], lookahead_mib=0).to("cuda")
    ids = prompt(3, PROMPT_SHAPE).cuda()
    want_tokens, want_logits = generate(without, ids, 3)
    tokens, logits = generate(served, ids, 3)
    assert torch.equal(tokens, want_tokens)
    assert_same_bits(logits, want_logits)
    torch.cuda.synchronize()
    assert all(t.stats()["prefetch_hits"] == 4 for t in tables(served).values())


def chunk_spellings():
    """Every way a generate call gives transformers its prefill chunk size."""
    from transformers import GenerationConfig

    config = GenerationConfig(prefill_chunk_size=3, max_new_tokens=3, do_sample=False,
                              return_dict_in_generate=True, output_logits=True)
    return {
        "keyword": ((), {"prefill_chunk_size": 3}),
        "a 0-d tensor": ((), {"prefill_chunk_size": torch.tensor(3)}),
        "a GenerationConfig, positionally": ((config,), {}),
        "a GenerationConfig, by name": ((), {"generation_config": config}),
    }


@pytest.mark.parametrize("spelling", list(chunk_spellings()))
def test_the_chunk_size_is_taken_where_transformers_takes_it(checkpoints, spelling):
    """Each spelling chunks the prefill in transformers, and ple reads every
    chunk after the first ahead: bits equal to transformers', a hit per chunk."""
    model_class = MODELS["qwen4exp"][0]
    reference = model_class.from_pretrained(checkpoints["qwen4exp"])
    served = from_pretrained(model_class, checkpoints["qwen4exp"])
    args, kwargs = chunk_spellings()[spelling]
    if not args and "generation_config" not in kwargs:
        kwargs = {**kwargs, "max_new_tokens": 3, "do_sample": False,
                  "return_dict_in_generate": True, "output_logits": True}
    ids = prompt(5, PROMPT_SHAPE)
    with torch.no_grad():
        want = reference.generate(ids, *args, **kwargs)
        for table in tables(served).values():
            table.reset_stats()
        got = served.generate(ids, *args, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert_same_bits(torch.stack(got.logits), torch.stack(want.logits))
    chunks = -(-PROMPT_SHAPE[1] // 3)
    assert [t.stats()["prefetch_hits"] for t in tables(served).values()] == (
        [chunks] * len(tables(served)))
