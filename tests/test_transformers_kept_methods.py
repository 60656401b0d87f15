"""A model that ple serves, held as users hold transformers' models: a kept
``model.generate`` or ``model.save_pretrained`` (bound, or in a
``functools.partial``) keeps working after the model's last name is
dropped, as with transformers alone; the class's function reaches ple's
generate too (its lookahead: each chunk after the first a prefetch hit);
and nothing of ple's keeps a model that nobody holds alive."""

from __future__ import annotations

import functools
import gc
import inspect
import weakref

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")

from transformers import GenerationMixin  # noqa: E402

from helpers import quiet_transformers  # noqa: E402, F401 (an autouse fixture)
from ple.integrations.transformers import from_pretrained, tables  # noqa: E402
from test_transformers_integration import MODELS, checkpoints, prompt  # noqa: E402, F401 (fixture)

PROMPT_SHAPE = (2, 9)
CHUNK = 3
OPTIONS = dict(max_new_tokens=3, do_sample=False)


def kept_references(model) -> dict:
    """What a program may keep of ``model.generate`` (each called with the
    prompt and OPTIONS)."""
    return {"bound": model.generate,
            "partial with a chunk size": functools.partial(model.generate,
                                                           prefill_chunk_size=CHUNK, **OPTIONS)}


@pytest.mark.parametrize("key", MODELS)
def test_a_kept_generate_of_a_dropped_model_generates(checkpoints, key):
    model_class = MODELS[key][0]
    ids = prompt(2, PROMPT_SHAPE)
    want = model_class.from_pretrained(checkpoints[key]).generate(ids, **OPTIONS)
    served = from_pretrained(model_class, checkpoints[key])
    kept = kept_references(served)
    del served
    gc.collect()
    assert torch.equal(kept["bound"](ids, **OPTIONS), want)
    model = kept["partial with a chunk size"].func.__self__
    for table in tables(model).values():
        table.reset_stats()
    assert torch.equal(kept["partial with a chunk size"](ids), want)
    chunks = -(-PROMPT_SHAPE[1] // CHUNK)
    assert [t.stats()["prefetch_hits"] for t in tables(model).values()] == (
        [chunks] * len(tables(model)))


def test_a_kept_save_pretrained_of_a_dropped_model_saves(checkpoints, tmp_path):
    model_class = MODELS["gemma3n"][0]
    served = from_pretrained(model_class, checkpoints["gemma3n"])
    bound, partial = served.save_pretrained, functools.partial(served.save_pretrained)
    del served
    gc.collect()
    bound(tmp_path / "bound")
    partial(tmp_path / "partial")
    assert (tmp_path / "bound" / "model.safetensors").read_bytes() == (
        tmp_path / "partial" / "model.safetensors").read_bytes()
    with safe_open(tmp_path / "bound" / "model.safetensors", "pt") as saved:
        assert "model.embed_tokens_per_layer.weight" in saved.keys()  # whole (test_transformers_save.py)


@pytest.mark.parametrize("key", MODELS)
def test_the_class_function_looks_ahead_too(checkpoints, key):
    model_class = MODELS[key][0]
    ids = prompt(3, PROMPT_SHAPE)
    served = from_pretrained(model_class, checkpoints[key])
    want = served.generate(ids, **OPTIONS)
    got = model_class.generate(served, ids, prefill_chunk_size=CHUNK, **OPTIONS)
    assert torch.equal(got, want)
    chunks = -(-PROMPT_SHAPE[1] // CHUNK)
    assert all(t.stats()["prefetch_hits"] == chunks for t in tables(served).values())


@pytest.mark.parametrize("key", MODELS)
def test_generate_keeps_transformers_signature_and_models_without_tables(checkpoints, key):
    model_class = MODELS[key][0]
    served = from_pretrained(model_class, checkpoints[key])
    assert served.generate.__self__ is served
    assert inspect.signature(model_class.generate) == inspect.signature(GenerationMixin.generate)
    assert model_class.generate.__doc__ == GenerationMixin.generate.__doc__
    plain = model_class.from_pretrained(checkpoints[key])  # the same class, ple's generate
    ids = prompt(4, PROMPT_SHAPE)
    assert torch.equal(plain.generate(ids, prefill_chunk_size=CHUNK, **OPTIONS),
                       served.generate(ids, **OPTIONS))


@pytest.mark.parametrize("key", MODELS)
def test_nothing_keeps_a_dropped_model_alive(checkpoints, key):
    served = from_pretrained(MODELS[key][0], checkpoints[key])
    served.generate(prompt(5, PROMPT_SHAPE), prefill_chunk_size=CHUNK, **OPTIONS)
    alive = weakref.ref(served)
    gc.disable()
    try:
        del served
        assert alive() is None
    finally:
        gc.enable()
