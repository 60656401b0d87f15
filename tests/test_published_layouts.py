"""The models as they are published: tiny random models laid out as the real
checkpoints are, loaded by ple and by transformers' own classes (the tables
in memory), compared to the bit.

- Qwen3.8-Flash-Next: ``Qwen4ExpForConditionalGeneration``, the text model
  under ``model.language_model.*``, the n-gram tables as shard families over
  many files with an index; once in fp32 and once with FP8 shards, one F32
  ``weight_scale`` each and a ``quantization_config`` in config.json.
- Gemma 3n E4B: ``Gemma3nForConditionalGeneration``'s layout
  (``model.language_model.embed_tokens_per_layer.weight``, a tied lm_head,
  many files), written by hand, as the text-only class reads it; and, where
  timm is installed (it needs a torchvision built for the installed torch),
  the multimodal class itself, its timm vision tower built from its config,
  saved by its own class and loaded by it and the auto classes.

Also: the auto classes, hub repo ids from a huggingface_hub cache laid out by
hand, the layers' constructors on these layouts, and the errors."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText,  # noqa: E402
                          Gemma3nConfig, Gemma3nForCausalLM, Gemma3nForConditionalGeneration,
                          Gemma3nModel, Gemma3nTextConfig, PreTrainedConfig, PreTrainedModel,
                          Qwen4ExpConfig, Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration)
from transformers.utils import is_timm_available  # noqa: E402

import ple  # noqa: E402
from helpers import quiet_transformers  # noqa: E402, F401 (an autouse fixture)
from helpers import REPO, assert_same_bits  # noqa: E402
from ple.integrations.transformers import from_pretrained, tables  # noqa: E402
from ple.integrations.transformers.modules import _TablesWarnedAbout  # noqa: E402
from ple.layers import DiskEmbedding, NGramEmbedding  # noqa: E402
from ple.table import _open_tables  # noqa: E402
from test_transformers_integration import (GEMMA_CONFIG, QWEN_CONFIG,  # noqa: E402
                                           assert_logits_depend_on, prompt)

QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                   patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
NGRAM = "layers.{}.ple.ple_embedding.ngram_embedding"
FP8_SCALE = 0.03125
# What the FP8 release's quantization_config converts (design.md, section 8).
FP8_MODULES = ["ple.ple_embedding.ngram_embedding"]
INTEGRATION = "ple.integrations.transformers.modules"
# Gemma 3n's vision tower, timm's mobilenetv5_300m_enc (built with
# pretrained=False), at the fewest channels its config allows (1.3M
# parameters, not 300M; its fusion adapter's 2048 outputs are fixed, hence
# hidden_size's default); the audio tower as small.
GEMMA_VISION = dict(model_args={"channel_multiplier": 0.01, "stem_size": 8})
GEMMA_AUDIO = dict(hidden_size=16, input_feat_size=16, conf_num_hidden_layers=1,
                   conf_num_attention_heads=2, sscp_conv_channel_size=[8, 4])
needs_timm = pytest.mark.skipif(not is_timm_available(), reason="timm is not installed (it needs a "
                                "torchvision built for the installed torch)")


def write_index(directory: Path, weight_map: dict[str, str]) -> None:
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def rewrite(directory: Path, change) -> None:
    """Each file of a sharded checkpoint rewritten as ``change(tensors)``
    gives it, the index following."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    weight_map = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors = change(load_file(directory / name))
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    write_index(directory, weight_map)


def to_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The n-gram shards as FP8 values of the scale FP8_SCALE, the scale as
    an F32 [1] ``<family>.weight_scale`` beside shard 0 (as published)."""
    out = {}
    for key, value in tensors.items():
        if ".ngram_embedding.shard_" not in key:
            out[key] = value
            continue
        out[key] = (value / FP8_SCALE).to(torch.float8_e4m3fn)
        if key.endswith(".shard_0.weight"):
            out[key.replace(".shard_0.weight", ".weight_scale")] = torch.tensor([FP8_SCALE])
    return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """{"fp32": directory, "fp8": directory}: a tiny Flash-Next as published,
    saved by its own class in 21 files; the FP8 one's quantization_config
    converts only the n-gram tables (its linears stay fp32)."""
    torch.manual_seed(0)
    config = Qwen4ExpConfig(text_config=QWEN_CONFIG, vision_config=QWEN_VISION,
                            tie_word_embeddings=False)
    model = Qwen4ExpForConditionalGeneration(config).eval()
    assert_logits_depend_on(model, [f"model.language_model.{NGRAM.format(i)}" for i in (0, 1)])
    fp32 = tmp_path_factory.mktemp("flash_next")
    model.save_pretrained(fp32, max_shard_size="64KB")
    fp8 = tmp_path_factory.mktemp("flash_next_fp8")
    shutil.copytree(fp32, fp8, dirs_exist_ok=True)
    rewrite(fp8, to_fp8)
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear) or type(module).__name__.endswith("Experts")})
    fields = json.loads((fp8 / "config.json").read_text())
    fields["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128],
                                     "modules_to_convert": FP8_MODULES,
                                     "modules_to_not_convert": linear}
    (fp8 / "config.json").write_text(json.dumps(fields, indent=2))
    return {"fp32": fp32, "fp8": fp8}


def randomize_altup(text_model) -> None:
    """Gemma 3n's altup output scales, zeros at init, made random (see
    test_transformers_integration's checkpoints)."""
    for layer in text_model.layers:
        torch.nn.init.normal_(layer.altup.correct_output_scale)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny Gemma 3n E4B as published: the text model's tensors under
    model.language_model, a tied lm_head, 16 files, a multimodal config."""
    torch.manual_seed(0)
    model = Gemma3nForCausalLM(Gemma3nTextConfig(**{**GEMMA_CONFIG, "tie_word_embeddings": True}))
    randomize_altup(model.model)
    assert_logits_depend_on(model.eval(), ["model.embed_tokens_per_layer"])
    directory = tmp_path_factory.mktemp("gemma_3n")
    model.save_pretrained(directory, max_shard_size="64KB")
    (directory / "config.json").unlink()
    rewrite(directory, lambda tensors: {key.replace("model.", "model.language_model.", 1): value
                                        for key, value in tensors.items()})
    config = Gemma3nConfig(text_config=model.config.to_dict(), tie_word_embeddings=True)
    config.architectures = ["Gemma3nForConditionalGeneration"]
    config.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def gemma_multimodal(tmp_path_factory):
    """A tiny Gemma 3n E4B saved by Gemma3nForConditionalGeneration itself
    (its timm vision tower and its audio tower random, from the config) in
    several files, its text model of gemma's config."""
    torch.manual_seed(0)
    config = Gemma3nConfig(text_config={**GEMMA_CONFIG, "tie_word_embeddings": True},
                           vision_config=GEMMA_VISION, audio_config=GEMMA_AUDIO,
                           tie_word_embeddings=True)
    model = Gemma3nForConditionalGeneration(config)
    randomize_altup(model.model.language_model)
    assert_logits_depend_on(model.eval(), ["model.language_model.embed_tokens_per_layer"])
    directory = tmp_path_factory.mktemp("gemma_3n_multimodal")
    model.save_pretrained(directory, max_shard_size="256KB")
    return directory


def output(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        result = model(ids)
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def ngram_module(model, index: int) -> torch.nn.Module:
    """The n-gram table's module of PLE layer ``index``, under any prefix."""
    return next(module for name, module in model.named_modules()
                if name.endswith(f".{NGRAM.format(index)}"))


# ---- Qwen3.8-Flash-Next ------------------------------------------------------------

# (the class asked for, the class it is, where the n-gram modules are)
QWEN_CLASSES = [
    (Qwen4ExpForConditionalGeneration, Qwen4ExpForConditionalGeneration, "model.language_model."),
    (Qwen4ExpForCausalLM, Qwen4ExpForCausalLM, "model."),
    (AutoModelForCausalLM, Qwen4ExpForCausalLM, "model."),
    (AutoModelForImageTextToText, Qwen4ExpForConditionalGeneration, "model.language_model."),
    (AutoModel, transformers.Qwen4ExpModel, "language_model."),
]


@pytest.mark.parametrize("asked, concrete, prefix", QWEN_CLASSES,
                         ids=[c[0].__name__ for c in QWEN_CLASSES])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bfloat16"])
def test_flash_next_every_class_equals_transformers(qwen, asked, concrete, prefix, dtype):
    """Each class, auto classes included, on the published layout: the class
    transformers builds, the tables served from their shard families, the
    outputs of transformers' own loading of the same class to the bit."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    reference, want = asked.from_pretrained(qwen["fp32"], output_loading_info=True, **kwargs)
    served, info = from_pretrained(asked, qwen["fp32"], output_loading_info=True, **kwargs)
    assert type(served) is type(reference) is concrete
    # Nothing missing, and nothing unexpected but what transformers finds so
    # (the base model has no lm_head).
    assert info["missing_keys"] == want["missing_keys"] == set()
    assert info["unexpected_keys"] == want["unexpected_keys"]
    names = [f"{prefix}{NGRAM.format(i)}" for i in (0, 1)]
    assert sorted(tables(served)) == names
    assert all(served.get_submodule(name).table.name == f"model.language_model.{NGRAM.format(i)}"
               for i, name in enumerate(names))
    ids = prompt()
    assert_same_bits(output(served, ids), output(reference, ids))


FP8_CASES = [
    # (the class asked for, the class whose transformers loading is right)
    (Qwen4ExpForConditionalGeneration, Qwen4ExpForConditionalGeneration),
    (AutoModelForCausalLM, AutoModelForCausalLM),
    (Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration),
]


@pytest.mark.parametrize("asked, right", FP8_CASES, ids=[c[0].__name__ for c in FP8_CASES])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bfloat16"])
def test_flash_next_fp8_is_scaled_as_the_right_class_does(qwen, asked, right, dtype, caplog,
                                                          monkeypatch):
    """The FP8 release: ple multiplies the rows by their weight_scale, as
    transformers' FP8Embedding does where the quantization_config reaches
    it (the multimodal class, AutoModelForCausalLM).  Qwen4ExpForCausalLM
    given the checkpoint directly drops the quantization_config and loads
    the values unscaled (transformers' bug): ple's outputs are the right
    class's, and a warning says that they differ from that class's (once
    per table in a process: here, with none warned about before)."""
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints with accelerate")
    monkeypatch.setattr(f"{INTEGRATION}._WARNED_UNSCALED", _TablesWarnedAbout())
    kwargs = {} if dtype is None else {"dtype": dtype}
    with caplog.at_level(logging.WARNING, logger=INTEGRATION):
        served = from_pretrained(asked, qwen["fp8"], **kwargs)
    reference = right.from_pretrained(qwen["fp8"], **kwargs)
    assert all(table.format == "fp8_e4m3fn" and table.scale == FP8_SCALE
               for table in tables(served).values())
    # The tables' rows: what ple serves equals the FP8Embedding's lookup.
    rows = torch.arange(0, 4096, 7)
    for i in (0, 1):
        with torch.no_grad():
            assert_same_bits(ngram_module(served, i)(rows), ngram_module(reference, i)(rows))
    ids = prompt()
    # In bfloat16 the quantizer keeps the skipped experts in float32 (the
    # text-only class, which has no quantizer, does not): the models differ
    # outside the tables, so only their tables are compared.
    if dtype is None or asked is not Qwen4ExpForCausalLM:
        assert_same_bits(output(served, ids), output(reference, ids))
    warnings = [r.getMessage() for r in caplog.records if r.name == INTEGRATION]
    if asked is not Qwen4ExpForCausalLM:
        assert warnings == []
        return
    # transformers' own text-only loading is the one that differs.
    assert not torch.equal(output(Qwen4ExpForCausalLM.from_pretrained(qwen["fp8"], **kwargs), ids),
                           output(reference, ids))
    assert warnings == [
        f"ple: Qwen4ExpForCausalLM.from_pretrained alone would load "
        f"model.language_model.{NGRAM.format(i)} (fp8_e4m3fn) unscaled; ple multiplies it by its "
        f"scale {FP8_SCALE:g}\n(no quantization_config converts it: text-only classes drop a "
        "multimodal checkpoint's), as the multimodal class and AutoModelForCausalLM do"
        for i in (0, 1)]


@pytest.mark.parametrize("kind", ["fp32", "fp8"])
def test_ngram_layers_on_the_published_layout(qwen, kind):
    """NGramEmbedding.from_safetensors with the multimodal config (the object
    and config.json's dict) finds each PLE layer's table under
    model.language_model and equals the n-gram module of the multimodal
    model that transformers loads (FP8Embedding for the FP8 release)."""
    if kind == "fp8":
        pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints with accelerate")
    directory = qwen[kind]
    reference = Qwen4ExpForConditionalGeneration.from_pretrained(directory)
    configs = [reference.config, json.loads((directory / "config.json").read_text())]
    tokens = prompt(1, (1, 12))[0]
    for config in configs:
        for index in (0, 1):
            layer = NGramEmbedding.from_safetensors(directory, model_config=config,
                                                    ple_layer_index=index, dtype=torch.float32)
            with layer.table:
                assert layer.table.name == f"model.language_model.{NGRAM.format(index)}"
                assert layer.table.scale == (FP8_SCALE if kind == "fp8" else 1.0)
                module = reference.model.language_model.layers[index].ple.ple_embedding
                with torch.no_grad():
                    assert_same_bits(layer(tokens), module(tokens[None], None)[0])


# ---- Gemma 3n E4B ------------------------------------------------------------------

def test_gemma_3n_text_class_on_the_published_layout(gemma):
    """Gemma3nForCausalLM on the multimodal checkpoint (transformers strips
    language_model): embed_tokens_per_layer served from
    model.language_model.embed_tokens_per_layer.weight, the tied lm_head
    kept in memory, logits and generation equal to transformers'."""
    reference = Gemma3nForCausalLM.from_pretrained(gemma)
    served, info = from_pretrained(Gemma3nForCausalLM, gemma, output_loading_info=True)
    assert info["unexpected_keys"] == set() and info["missing_keys"] == set()
    table = tables(served)["model.embed_tokens_per_layer"]
    assert table.name == "model.language_model.embed_tokens_per_layer.weight"
    assert served.lm_head.weight is served.model.embed_tokens.weight
    ids = prompt()
    assert_same_bits(output(served, ids), output(reference, ids))
    with torch.no_grad():
        assert torch.equal(served.generate(ids, max_new_tokens=3, do_sample=False),
                           reference.generate(ids, max_new_tokens=3, do_sample=False))


@pytest.mark.skipif(is_timm_available(), reason="timm is installed")
@pytest.mark.parametrize("asked, concrete", [(AutoModelForCausalLM, "Gemma3nForConditionalGeneration"),
                                             (AutoModel, "Gemma3nModel")])
def test_gemma_3n_multimodal_classes_say_they_need_timm(gemma, asked, concrete):
    before = len(_open_tables)
    with pytest.raises(ImportError) as caught:
        from_pretrained(asked, gemma)
    assert str(caught.value) == (
        f"{concrete} builds its vision tower with timm, which is not installed (pip install timm, "
        "which needs a torchvision built for the installed torch); for text only, load the "
        "checkpoint with Gemma3nForCausalLM, which needs no timm")
    assert len(_open_tables) == before


@needs_timm
def test_gemma_3n_multimodal_class_saves_the_layout_written_by_hand(gemma, gemma_multimodal):
    """What Gemma3nForConditionalGeneration.save_pretrained writes: the
    per-layer table under its published name, no lm_head (tied), several
    files, and its text model's tensors those of the layout written by hand
    (by name, shape and dtype)."""
    def tensors(directory):
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        weight_map = index["weight_map"]
        files = sorted(set(weight_map.values()))
        shapes = {}
        for name in files:
            shapes.update({key: (value.shape, value.dtype)
                           for key, value in load_file(directory / name).items()})
        assert sorted(shapes) == sorted(weight_map)
        return files, shapes

    files, saved = tensors(gemma_multimodal)
    assert len(files) > 1
    rows, layers = GEMMA_CONFIG["vocab_size_per_layer_input"], GEMMA_CONFIG["num_hidden_layers"]
    assert saved["model.language_model.embed_tokens_per_layer.weight"] == (
        torch.Size([rows, layers * GEMMA_CONFIG["hidden_size_per_layer_input"]]), torch.float32)
    assert not any(key.startswith("lm_head") for key in saved)
    assert any(key.startswith("model.vision_tower.timm_model.") for key in saved)
    _, by_hand = tensors(gemma)
    assert {key: value for key, value in saved.items()
            if key.startswith("model.language_model.")} == by_hand


# (the class asked for, the class it is, where the per-layer table is)
GEMMA_CLASSES = [
    (Gemma3nForConditionalGeneration, Gemma3nForConditionalGeneration, "model.language_model."),
    (AutoModelForImageTextToText, Gemma3nForConditionalGeneration, "model.language_model."),
    (AutoModelForCausalLM, Gemma3nForConditionalGeneration, "model.language_model."),
    (AutoModel, Gemma3nModel, "language_model."),
]


@needs_timm
@pytest.mark.parametrize("asked, concrete, prefix", GEMMA_CLASSES,
                         ids=[c[0].__name__ for c in GEMMA_CLASSES])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bfloat16"])
def test_gemma_3n_multimodal_classes_equal_transformers(gemma_multimodal, asked, concrete, prefix,
                                                        dtype):
    """The multimodal class and the auto classes on the checkpoint its own
    save_pretrained wrote: the class transformers builds (the timm vision
    tower loaded, nothing missing), embed_tokens_per_layer served from
    model.language_model.embed_tokens_per_layer.weight, the tied lm_head
    kept in memory, text-only logits and greedy generation equal to
    transformers' own loading to the bit."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    reference, want = asked.from_pretrained(gemma_multimodal, output_loading_info=True, **kwargs)
    served, info = from_pretrained(asked, gemma_multimodal, output_loading_info=True, **kwargs)
    assert type(served) is type(reference) is concrete
    assert info["missing_keys"] == want["missing_keys"] == set()
    assert info["unexpected_keys"] == want["unexpected_keys"]
    assert list(tables(served)) == [f"{prefix}embed_tokens_per_layer"]
    table = tables(served)[f"{prefix}embed_tokens_per_layer"]
    assert table.name == "model.language_model.embed_tokens_per_layer.weight"
    base = served.model if concrete is Gemma3nForConditionalGeneration else served
    assert type(base.vision_tower).__name__ == "TimmWrapperModel"
    ids = prompt()
    assert_same_bits(output(served, ids), output(reference, ids))
    if concrete is Gemma3nModel:  # no lm_head, no generation
        return
    assert served.lm_head.weight is served.model.language_model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(served.generate(ids, max_new_tokens=3, do_sample=False),
                           reference.generate(ids, max_new_tokens=3, do_sample=False))


def test_disk_embedding_finds_the_published_name(gemma, tmp_path):
    """The README's name, model.embed_tokens_per_layer.weight, on the
    published checkpoint; and the published name on a text checkpoint."""
    weight = Gemma3nForCausalLM.from_pretrained(gemma).model.embed_tokens_per_layer.weight.detach()
    ids = torch.randint(0, weight.shape[0], (3, 5), generator=torch.Generator().manual_seed(0))
    with DiskEmbedding.from_safetensors(gemma, "model.embed_tokens_per_layer.weight") as module:
        assert module.table.name == "model.language_model.embed_tokens_per_layer.weight"
        assert_same_bits(module(ids), torch.nn.functional.embedding(ids, weight))
    save_file({"model.embed_tokens_per_layer.weight": weight}, tmp_path / "text.safetensors")
    with ple.Table.from_safetensors(tmp_path, "model.language_model.embed_tokens_per_layer.weight") as t:
        assert t.name == "model.embed_tokens_per_layer.weight"


# ---- errors ------------------------------------------------------------------------

def test_a_missing_name_gives_the_closest_names_and_no_paths(gemma, tmp_path):
    save_file({"model.language_model.embed_tokens.weight": torch.zeros(4, 2),
               "model.language_model.embed_tokens_per_layer.weight": torch.zeros(4, 2)},
              tmp_path / "a.safetensors")
    save_file({"model.language_model.norm.weight": torch.zeros(2)}, tmp_path / "b.safetensors")
    save_file({f"x.shard_{i}.weight": torch.zeros(2, 2) for i in (0, 1)},
              tmp_path / "c.safetensors")
    with pytest.raises(ValueError) as caught:
        DiskEmbedding.from_safetensors(tmp_path, "model.embed_tokens_per_layr.weight")
    assert str(caught.value) == (
        f"3 safetensors files in {tmp_path}: no tensor or shard family named "
        "'model.embed_tokens_per_layr.weight' or 'model.language_model.embed_tokens_per_layr.weight'"
        "; the closest of their 5 tensors: ['model.language_model.embed_tokens_per_layer.weight', "
        "'model.language_model.embed_tokens.weight', 'model.language_model.norm.weight', "
        "'x.shard_*']")
    # The published checkpoint's 16 files: counted, not listed.
    with pytest.raises(ValueError) as caught:
        DiskEmbedding.from_safetensors(gemma, "model.embed_tokens_per_layr.weight")
    message = str(caught.value)
    assert message.startswith(f"16 safetensors files in {gemma}: no tensor or shard family named")
    assert "'model.language_model.embed_tokens_per_layer.weight'" in message
    assert ".safetensors" not in message.replace(f"{gemma}: ", "") and len(message) < 600


# (Path("") is Path("."), the working directory named as such.)
@pytest.mark.parametrize("path", ["", [""]], ids=["str", "list"])
def test_an_empty_path_is_refused(path):
    with pytest.raises(ValueError, match=r"^an empty path names no table file \(it would be the "
                                         r"working directory\); give a file or a directory$"):
        ple.Table.from_safetensors(path)


def test_an_empty_path_is_refused_by_the_layers():
    with pytest.raises(ValueError, match=r"^an empty path names no table file"):
        DiskEmbedding.from_safetensors("", "t")
    with pytest.raises(ValueError, match=r"^an empty path names no table file"):
        NGramEmbedding.from_safetensors("", vocab_size=10, eos_id=1)


class TinyConfig(PreTrainedConfig):
    model_type = "ple_test_tiny"

    def __init__(self, rows: int = 64, cols: int = 8, **kwargs):
        self.rows, self.cols = rows, cols
        super().__init__(**kwargs)


class Tiny(PreTrainedModel):
    """A model whose n-gram table is not in a Qwen4Exp n-gram module, so
    offload="auto" does not know it.  Its norm keeps a parameter in memory,
    as every model has: transformers reads the model's device from one."""

    config_class = TinyConfig

    def __init__(self, config):
        super().__init__(config)
        self.ngram_embedding = torch.nn.Embedding(config.rows, config.cols)
        self.norm = torch.nn.LayerNorm(config.cols)
        self.post_init()

    def forward(self, ids):
        return self.norm(self.ngram_embedding(ids))


def test_auto_refuses_to_leave_a_table_to_memory_before_reading_it(tmp_path, monkeypatch):
    torch.manual_seed(0)
    Tiny(TinyConfig()).save_pretrained(tmp_path)
    reference = Tiny.from_pretrained(tmp_path)
    before = len(_open_tables)
    with monkeypatch.context() as patched:
        def read(*args, **kwargs):
            raise AssertionError("transformers started reading the weights")

        patched.setattr(PreTrainedModel, "_load_pretrained_model", staticmethod(read))
        with pytest.raises(ValueError) as caught:
            from_pretrained(Tiny, tmp_path)
    assert str(caught.value) == (
        f"ple: offload='auto' would leave the table 'ngram_embedding' of {tmp_path}/model.safetensors"
        " to be read into memory as 'ngram_embedding.weight': no module of Tiny there is one that "
        "'auto' serves (a Qwen4Exp n-gram module's ngram_embedding, an nn.Embedding named "
        "embed_tokens_per_layer); name the module in offload=[...] to serve it, or pass offload=[] "
        "to load it into memory")
    assert len(_open_tables) == before
    ids = torch.tensor([[0, 63, 5]])
    served = from_pretrained(Tiny, tmp_path, offload=["ngram_embedding"])
    with torch.no_grad():
        assert_same_bits(served(ids), reference(ids))
    in_memory = from_pretrained(Tiny, tmp_path, offload=[])
    assert tables(in_memory) == {}


# ---- the hub's cache ---------------------------------------------------------------

REPO_ID = "google/gemma-3n-E4B-it"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(cache: Path, repo: str, source: Path, commit: str, refs=("main",)) -> Path:
    """huggingface_hub's cache layout of ``repo`` at ``commit``, made by hand:
    each file of ``source`` a blob named by its sha256, the snapshot's files
    relative links into blobs/, each of ``refs`` naming the commit.  Returns
    the snapshot's folder."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        blob = root / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


def test_a_repo_id_loads_from_the_hub_cache(gemma, tmp_path):
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, REPO_ID, gemma, COMMIT, refs=("main", "v1"))
    reference = Gemma3nForCausalLM.from_pretrained(gemma)
    ids = prompt()
    for revision in (None, "v1", COMMIT):
        served = from_pretrained(Gemma3nForCausalLM, REPO_ID, cache_dir=cache, revision=revision)
        table = tables(served)["model.embed_tokens_per_layer"]
        # The blobs that the snapshot's links name: a table opens its files' real paths.
        blobs = {link.resolve() for link in snapshot.rglob("*.safetensors")}
        assert table.paths and set(table.paths) <= blobs
        assert_same_bits(output(served, ids), output(reference, ids))
    if not is_timm_available():  # an auto class over the cache: resolved from its config
        with pytest.raises(ImportError, match="^Gemma3nForConditionalGeneration builds its vision"):
            from_pretrained(AutoModelForCausalLM, REPO_ID, cache_dir=cache)
    with pytest.raises(FileNotFoundError) as caught:
        from_pretrained(Gemma3nForCausalLM, "google/gemma-3n-E2B-it", cache_dir=cache)
    assert str(caught.value) == (
        f"google/gemma-3n-E2B-it: not a local directory, and huggingface_hub's cache ({cache}) has "
        "no snapshot of it at revision 'main': download it first (hf download "
        "google/gemma-3n-E2B-it), or pass local_files_only=False to let from_pretrained download it")
    with pytest.raises(FileNotFoundError, match="has no snapshot of it at revision 'v2'"):
        from_pretrained(Gemma3nForCausalLM, REPO_ID, cache_dir=cache, revision="v2")


CHILD = textwrap.dedent("""
    import sys, torch, transformers
    from transformers import Gemma3nForCausalLM
    from ple.integrations.transformers import from_pretrained, tables
    transformers.logging.set_verbosity_error()
    served = from_pretrained(Gemma3nForCausalLM, sys.argv[1])
    ids = torch.tensor([[5, 17, 1, 200, 9]])
    with torch.no_grad():
        torch.save(served(ids).logits, sys.argv[2])
    print(tables(served)["model.embed_tokens_per_layer"].paths[0])
""")


def test_hf_hub_cache_names_the_cache(gemma, tmp_path):
    """HF_HUB_CACHE, as a user sets it, with the hub offline (nothing here
    reaches a network)."""
    snapshot = hub_cache(tmp_path / "hub", REPO_ID, gemma, COMMIT)
    environment = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", CHILD, REPO_ID, str(tmp_path / "logits.pt")],
                         capture_output=True, text=True, timeout=300, env=environment, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.strip().splitlines()[-1]) in {
        link.resolve() for link in snapshot.rglob("*.safetensors")}
    with torch.no_grad():
        want = Gemma3nForCausalLM.from_pretrained(gemma)(torch.tensor([[5, 17, 1, 200, 9]])).logits
    assert_same_bits(torch.load(tmp_path / "logits.pt"), want)


# ---- a folder named ple -------------------------------------------------------------

def test_a_folder_named_ple_in_the_working_directory_is_named(tmp_path):
    """Python imports such a folder (not a checkout of ple, whose top folder
    gives way: tests/test_checkout_imports.py) as a namespace package in
    place of ple installed in editable mode; ple.files says so."""
    (tmp_path / "ple").mkdir()
    run = subprocess.run([sys.executable, "-c", "import ple.files"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == (
        f"ImportError: 'ple' was imported as a namespace package from {tmp_path / 'ple'}: a folder "
        "named 'ple' there (a clone of the ple repository?) hides the installed ple, whose "
        "operators are then never registered; run Python from another folder")
