"""Lookahead in the transformers integration: ``generate(...,
prefill_chunk_size=N)`` of tiny random Qwen4Exp and Gemma 3n models served
by ple gives the tokens and logits of transformers' own model and of ple
without lookahead, bit for bit, for chunks of one token, a partial last
chunk and one chunk, two requests with an EOS inside; each chunk after the
first is a prefetch hit; nothing is read ahead after generate returns or
raises; on CUDA too (skipped without a GPU)."""

from __future__ import annotations

import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")

from helpers import assert_same_bits, quiet_transformers  # noqa: E402, F401 (an autouse fixture)
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
    calls = {name: t.stats()["calls"] for name, t in tables(served).items()}
    time.sleep(0.2)  # a read left running would count here
    assert calls == {name: t.stats()["calls"] for name, t in tables(served).items()}


@pytest.mark.parametrize("bad", [-1, 257, 1.5])
def test_a_bad_lookahead_bound_is_refused(checkpoints, bad):
    with pytest.raises(ValueError, match=r"lookahead_mib must be an int in \[0, 256\]"):
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
