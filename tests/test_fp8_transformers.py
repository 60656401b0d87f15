"""FP8 tables against transformers' own FP8 path, to the bit.

A tiny random Qwen4Exp saved with save_pretrained, its n-gram shards then
stored as FP8 E4M3 with an F32 ``weight_scale`` of shape [1] and the
config's ``quantization_config`` converting the n-gram embeddings, as the
published FP8 checkpoint has them.  transformers loads it with its
``FP8Embedding`` (``rows.to(dtype) * weight_scale``, the scale cast to the
model's dtype by its loader); ple's layers and ``from_pretrained`` must give
the same rows and logits in bfloat16, float16 and float32, at scales that are
no bfloat16 or float16 value (1e-3, 3e-4, 7.3e-5) and at a power of two, as
loaded and after any sequence of casts of the model (``to``, ``half``,
``float``, ``bfloat16``, ``double``).  The CUDA tests (skipped without a GPU)
run both models on the GPU.
"""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")
pytest.importorskip("accelerate", reason="transformers' FP8 loading needs accelerate")

from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: E402

from helpers import quiet_transformers  # noqa: E402, F401 (an autouse fixture)
from helpers import assert_same_bits  # noqa: E402
import ple.integrations.transformers.modules as integration  # noqa: E402
from ple.integrations.transformers import from_pretrained, tables  # noqa: E402
from ple.layers import DiskEmbedding, NGramEmbedding  # noqa: E402
from ple_tools.bench_transformers import MODEL_CONFIG  # noqa: E402

CONFIG = {**MODEL_CONFIG, "vocab_size": 256, "hidden_size": 64, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 32, "hc_lowrank": 8, "ple_embed_dim": 32,
          "ngram_vocab_size_base": 1000, "split_ngram_parts": 4}
TABLES = [f"model.layers.{i}.ple.ple_embedding.ngram_embedding" for i in (0, 1)]
SCALES = (1e-3, 3e-4, 7.3e-5, 2.0 ** -10)
EXACT_SCALE = 2.0 ** -10
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SHARD = re.compile(r"^(?P<table>.+\.ngram_embedding)\.shard_(?P<index>\d+)\.weight$")


@pytest.fixture(scope="module", params=SCALES, ids=lambda s: f"scale{s:g}")
def checkpoint(request, tmp_path_factory):
    """The FP8 checkpoint of a tiny Qwen4Exp whose n-gram tables are scaled by
    ``request.param``; the shards over several files."""
    scale = request.param
    directory = tmp_path_factory.mktemp(f"fp8-{scale:g}")
    write_checkpoint(directory, scale)
    return directory, scale


def write_checkpoint(directory, scale: float, converted: bool = True) -> None:
    """The checkpoint, in ``directory``; ``converted``: its config's
    quantization_config converts the n-gram embeddings (else it has none)."""
    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**CONFIG)).eval()
    model.save_pretrained(directory, max_shard_size="64KB")
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for file in sorted(directory.glob("*.safetensors")):
        tensors = load_file(file)
        shards = {key: SHARD.match(key) for key in tensors if SHARD.match(key)}
        if not shards:
            continue
        for key, match in shards.items():
            # Values of a few hundred units of the scale: every FP8 exponent is used.
            tensors[key] = (tensors[key] / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            if match["index"] == "0":
                scale_key = f"{match['table']}.weight_scale"
                tensors[scale_key] = torch.tensor([scale], dtype=torch.float32)
                index["weight_map"][scale_key] = file.name
        save_file(tensors, str(file), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    if not converted:
        return
    config = json.loads((directory / "config.json").read_text())
    # dequantize: what transformers sets by itself without a GPU; with one it
    # would also make every nn.Linear an FP8Linear, whose FP8 weights this
    # checkpoint does not have.  The embeddings are FP8Embedding either way.
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "modules_to_convert": ["ple.ple_embedding.ngram_embedding"],
                                     "dequantize": True}
    (directory / "config.json").write_text(json.dumps(config))


def reference_model(directory, dtype):
    model = Qwen4ExpForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    for name in TABLES:
        module = model.get_submodule(name)
        assert type(module).__name__ == "FP8Embedding"
        assert module.weight.dtype == torch.float8_e4m3fn
        assert module.weight_scale.dtype == dtype  # the loader's cast: the arithmetic under test
    return model


def prompt(seed: int = 0, shape=(2, 9)) -> torch.Tensor:
    ids = torch.randint(3, 256, shape, generator=torch.Generator().manual_seed(seed))
    ids[0, shape[1] // 2] = 1  # an EOS inside
    return ids


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_equal_fp8_embedding(checkpoint, dtype):
    """Every row of each table: DiskEmbedding(round_scale=True) and the
    integration's module against transformers' FP8Embedding; the float32
    product (round_scale=False) differs wherever the scale is no value of
    the dtype, so the comparison can tell them apart."""
    directory, scale = checkpoint
    reference = reference_model(directory, dtype)
    served = from_pretrained(Qwen4ExpForCausalLM, directory, dtype=dtype)
    for name in TABLES:
        ids = torch.arange(reference.get_submodule(name).num_embeddings)
        with torch.no_grad():
            want = reference.get_submodule(name)(ids)
        module = served.get_submodule(name)
        assert isinstance(module, DiskEmbedding) and module.round_scale
        assert_same_bits(module(ids), want)
        for round_scale in (True, False):
            with DiskEmbedding.from_safetensors(directory, name, dtype=dtype,
                                                round_scale=round_scale) as own:
                if round_scale:
                    assert_same_bits(own(ids), want)
                else:
                    differ = not torch.equal(own(ids), want)
                    assert differ == (dtype != torch.float32 and scale != EXACT_SCALE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ngram_embedding_equals_transformers_module(checkpoint, dtype):
    """NGramEmbedding, by default, against the whole Qwen4Exp n-gram module
    (its hashing and transformers' FP8Embedding)."""
    directory, _ = checkpoint
    reference = reference_model(directory, dtype)
    tokens = prompt(3, (1, 40))[0]
    for index, name in enumerate(TABLES):
        module = reference.get_submodule(name.rpartition(".")[0])
        layer = NGramEmbedding.from_safetensors(directory, model_config=reference.config,
                                                ple_layer_index=index, dtype=dtype)
        with layer.table:
            assert layer.table.name == name
            with torch.no_grad():
                assert_same_bits(layer(tokens), module(tokens[None], None)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logits_equal_transformers(checkpoint, dtype):
    directory, _ = checkpoint
    reference = reference_model(directory, dtype)
    served, info = from_pretrained(Qwen4ExpForCausalLM, directory, dtype=dtype,
                                   output_loading_info=True)
    assert info["unexpected_keys"] == set() and info["missing_keys"] == set()
    assert sorted(tables(served)) == TABLES
    ids = prompt()
    with torch.no_grad():
        want = reference(ids).logits
        assert want.isfinite().all()
        assert_same_bits(served(ids).logits, want)
        assert torch.equal(served.generate(ids, max_new_tokens=4, do_sample=False),
                           reference.generate(ids, max_new_tokens=4, do_sample=False))


def test_the_float32_product_changes_the_logits(checkpoint):
    """The logits see the difference the rounding makes (at a scale that is
    no bfloat16 value), so the equality above tests the arithmetic."""
    directory, scale = checkpoint
    if scale == EXACT_SCALE:
        pytest.skip("at a power of two both arithmetics agree")
    reference = reference_model(directory, torch.bfloat16)
    served = from_pretrained(Qwen4ExpForCausalLM, directory, dtype=torch.bfloat16,
                             round_scale=False)
    assert not any(module.round_scale for module in served.modules()
                   if isinstance(module, DiskEmbedding))
    with torch.no_grad():
        assert not torch.equal(served(prompt()).logits, reference(prompt()).logits)


# Casts of a whole model as a user calls them, in turn: narrowing, widening
# and back; each rounds FP8Embedding's weight_scale again (transformers'
# dequantized FP8 model is no quantized model to it: every cast is allowed).
CASTS = (("to(float16)", lambda m: m.to(torch.float16)), ("float()", lambda m: m.float()),
         ("bfloat16()", lambda m: m.bfloat16()), ("half()", lambda m: m.half()),
         ("to(float32)", lambda m: m.to(dtype=torch.float32)),
         ("to(bfloat16)", lambda m: m.to(torch.bfloat16)))


def assert_logits_equal_after_each_cast(reference, served, ids):
    for what, cast in CASTS:
        cast(reference), cast(served)
        dtype = reference.get_submodule(TABLES[0]).weight_scale.dtype
        with torch.no_grad():
            want = reference(ids).logits
            assert want.dtype == dtype and want.isfinite().all(), what
            assert_same_bits(served(ids).logits, want)
        for name in TABLES:
            assert served.get_submodule(name).weight_scale.dtype == dtype, what
            assert torch.equal(served.get_submodule(name).weight_scale.float(),
                               reference.get_submodule(name).weight_scale.float()), what


def test_logits_equal_transformers_after_casts(checkpoint):
    """Loaded in bfloat16, then cast, both models the same way:
    transformers' scale is cast from the one it holds (a bfloat16 scale
    cast to float16 is rounded twice), and ple's follows it.  (The rows
    test below starts from every dtype.)"""
    directory, _ = checkpoint
    reference = reference_model(directory, torch.bfloat16)
    served = from_pretrained(Qwen4ExpForCausalLM, directory, dtype=torch.bfloat16)
    assert_logits_equal_after_each_cast(reference, served, prompt(7))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_equal_fp8_embedding_after_casts(checkpoint, dtype):
    """Each table's modules alone, through casts that include float64 (which
    the whole model does not run in): every row, bit for bit."""
    directory, _ = checkpoint
    reference = reference_model(directory, dtype)
    served = from_pretrained(Qwen4ExpForCausalLM, directory, dtype=dtype)
    casts = (*CASTS[:3], ("double()", lambda m: m.double()), *CASTS[3:],
             ("to(float64)", lambda m: m.to(torch.float64)), ("half()", lambda m: m.half()))
    for name in TABLES:
        want_module, got_module = reference.get_submodule(name), served.get_submodule(name)
        ids = torch.arange(want_module.num_embeddings)
        for what, cast in casts:
            cast(want_module), cast(got_module)
            with torch.no_grad():
                want = want_module(ids)
            assert want.dtype == got_module.dtype, what
            assert_same_bits(got_module(ids), want)


def test_a_cast_model_is_not_the_model_loaded_in_that_dtype(checkpoint):
    """What the tests above tell apart: at a scale that is no bfloat16
    value, a bfloat16 model cast to float16 or float32 (its scale rounded
    through bfloat16) computes other logits than one loaded in that dtype."""
    directory, scale = checkpoint
    if scale != SCALES[0]:
        pytest.skip("one scale that is no bfloat16 value shows it")
    for dtype in (torch.float16, torch.float32):
        cast = from_pretrained(Qwen4ExpForCausalLM, directory, dtype=torch.bfloat16).to(dtype)
        loaded = from_pretrained(Qwen4ExpForCausalLM, directory, dtype=dtype)
        with torch.no_grad():
            assert not torch.equal(cast(prompt()).logits, loaded(prompt()).logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_logits_equal_transformers_after_casts(checkpoint, dtype):
    """On the GPU: both models moved there, then cast in turn (the scale read
    back from the device once per cast), each table's rows and the logits."""
    directory, _ = checkpoint
    reference = reference_model(directory, dtype).to("cuda")
    served = from_pretrained(Qwen4ExpForCausalLM, directory, dtype=dtype).to("cuda")
    assert all(served.get_submodule(name).weight_scale.is_cuda for name in TABLES)
    assert_logits_equal_after_each_cast(reference, served, prompt(9).cuda())
    for name in TABLES:
        rows = torch.arange(reference.get_submodule(name).num_embeddings, device="cuda")
        with torch.no_grad():
            assert_same_bits(served.get_submodule(name)(rows), reference.get_submodule(name)(rows))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_logits_equal_transformers(checkpoint, dtype):
    """Both models on the GPU: transformers' FP8Embedding multiplies there in
    torch's CUDA arithmetic, ple's rows come from its Triton decoder."""
    directory, _ = checkpoint
    reference = reference_model(directory, dtype).to("cuda")
    served = from_pretrained(Qwen4ExpForCausalLM, directory, dtype=dtype).to("cuda")
    ids = prompt(5).cuda()
    with torch.no_grad():
        for name in TABLES:
            rows = torch.arange(reference.get_submodule(name).num_embeddings, device="cuda")
            got = served.get_submodule(name)(rows)
            assert got.is_cuda
            assert_same_bits(got, reference.get_submodule(name)(rows))
        want = reference(ids).logits
        assert want.isfinite().all()
        assert_same_bits(served(ids).logits, want)


def test_the_unscaled_warning_is_heard_once_per_table(tmp_path, caplog, monkeypatch):
    """Where no quantization_config converts the n-gram modules,
    transformers' class alone would load them unscaled and ple says so in
    two lines, once per table in a process however many loads open it (a
    benchmark's arms); another checkpoint's tables, in other files, get
    their own warning."""
    monkeypatch.setattr(integration, "_WARNED_UNSCALED", integration._TablesWarnedAbout())
    first, other = tmp_path / "first", tmp_path / "other"
    write_checkpoint(first, 1e-3, converted=False)
    shutil.copytree(first, other)

    def warnings_of(directory, loads: int = 1) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=integration.__name__):
            for _ in range(loads):
                model = from_pretrained(Qwen4ExpForCausalLM, directory, dtype=torch.bfloat16)
                assert sorted(tables(model)) == TABLES
        return [r.getMessage() for r in caplog.records if r.name == integration.__name__]

    said = warnings_of(first, loads=3)
    assert said == [
        f"ple: Qwen4ExpForCausalLM.from_pretrained alone would load {name} (fp8_e4m3fn) "
        "unscaled; ple multiplies it by its scale 0.001\n(no quantization_config converts it: "
        "text-only classes drop a multimodal checkpoint's), as the multimodal class and "
        "AutoModelForCausalLM do" for name in TABLES]
    assert warnings_of(first) == []
    assert warnings_of(other) == said
    assert warnings_of(other) == []
