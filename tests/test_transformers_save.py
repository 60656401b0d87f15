"""save_pretrained of a model that ple.integrations.transformers.from_pretrained
loaded refuses the directory its tables are served from (transformers would
overwrite model.safetensors and delete the shards it does not write again),
before writing anything, and saves elsewhere as before: the model without
its offloaded tables.  The guard survives pickling and deepcopy, bound to
the copy, and keeps no reference cycle (the model is freed, its tables
closed, once dropped)."""

from __future__ import annotations

import copy
import gc
import io
import shutil
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")

from safetensors import safe_open  # noqa: E402
from transformers import (Gemma3nForCausalLM, Gemma3nTextConfig, Qwen4ExpForCausalLM,  # noqa: E402
                          Qwen4ExpTextConfig)

from helpers import quiet_transformers  # noqa: E402, F401 (an autouse fixture)
from helpers import directory_bytes  # noqa: E402
from ple.integrations.transformers import from_pretrained, tables  # noqa: E402

from test_transformers_integration import GEMMA_CONFIG, QWEN_CONFIG  # noqa: E402

# Qwen4Exp in shards (transformers deletes the ones it does not write
# again), Gemma 3n in one model.safetensors (transformers overwrites it).
MODELS = {"qwen4exp": (Qwen4ExpForCausalLM, Qwen4ExpTextConfig, QWEN_CONFIG,
                       {"max_shard_size": "64KB"}),
          "gemma3n": (Gemma3nForCausalLM, Gemma3nTextConfig, GEMMA_CONFIG, {})}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{model: directory}: each tiny model saved with save_pretrained."""
    directories = {}
    for key, (model_class, config_class, fields, options) in MODELS.items():
        torch.manual_seed(0)
        directory = tmp_path_factory.mktemp(key)
        model_class(config_class(**fields)).save_pretrained(directory, **options)
        directories[key] = directory
    assert len(list(directories["qwen4exp"].glob("*.safetensors"))) > 2
    assert [p.name for p in directories["gemma3n"].glob("*.safetensors")] == ["model.safetensors"]
    return directories


@pytest.fixture
def checkpoint(saved, tmp_path, request):
    """A copy of a saved model's directory, and the model loaded from it."""
    key = request.param
    directory = tmp_path / "checkpoint"
    shutil.copytree(saved[key], directory)
    model = from_pretrained(MODELS[key][0], directory)
    assert tables(model)
    yield directory, model


def refusal(directory, names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    one = len(names) == 1
    return (f"save_pretrained: {directory} holds the files of {len(names)} of this model's ple "
            f"table{'' if one else 's'} ({shown}), which ple serves from there; transformers' "
            "save_pretrained would overwrite or delete them (it writes model.safetensors, and "
            "deletes the shards of an earlier save that it does not write again). Save into "
            "another directory: the model is saved without its offloaded tables, so keep this "
            "checkpoint too")


@pytest.mark.parametrize("checkpoint", sorted(MODELS), indirect=True)
def test_saving_into_the_tables_directory_is_refused(checkpoint):
    directory, model = checkpoint
    before = directory_bytes(directory)
    names = sorted(tables(model))
    with pytest.raises(ValueError) as error:
        model.save_pretrained(directory)
    assert str(error.value) == refusal(directory, names)
    assert directory_bytes(directory) == before


@pytest.mark.parametrize("checkpoint", ["qwen4exp"], indirect=True)
def test_the_same_directory_by_another_path_is_refused(checkpoint, tmp_path):
    """A symlink to the directory, or the path with a ``..`` in it."""
    directory, model = checkpoint
    before = directory_bytes(directory)
    (tmp_path / "link").symlink_to(directory)
    (tmp_path / "sub").mkdir()
    for other in (tmp_path / "link", tmp_path / "sub" / ".." / "checkpoint"):
        with pytest.raises(ValueError) as error:
            model.save_pretrained(other, max_shard_size="64KB")
        assert str(error.value) == refusal(other, sorted(tables(model)))
    assert directory_bytes(directory) == before


@pytest.mark.parametrize("checkpoint", sorted(MODELS), indirect=True)
def test_saving_elsewhere_writes_the_model_without_its_tables(checkpoint, tmp_path):
    directory, model = checkpoint
    out = tmp_path / "out"
    model.save_pretrained(out)
    keys = set()
    for file in out.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            keys.update(f.keys())
    assert keys and not any("ngram_embedding" in key or "embed_tokens_per_layer" in key
                            for key in keys)
    assert (out / "config.json").is_file()


def test_copies_refuse_too_and_nothing_keeps_the_model_alive(saved, tmp_path):
    directory = tmp_path / "checkpoint"
    shutil.copytree(saved["qwen4exp"], directory)
    model = from_pretrained(Qwen4ExpForCausalLM, directory)
    names = sorted(tables(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    for other in copies:
        assert type(other) is Qwen4ExpForCausalLM
        with pytest.raises(ValueError) as error:
            other.save_pretrained(directory)
        assert str(error.value) == refusal(directory, names)
        other.save_pretrained(tmp_path / f"out{len(names)}")  # elsewhere: saved
    del copies, other
    alive = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert alive() is None
    finally:
        gc.enable()


def test_bench_checkpoint_lists_exactly_its_files(tmp_path):
    """tools/bench_transformers.py's checkpoint: its ple_bench.json lists
    every file it wrote and nothing else is there; reused for the same size,
    replaced without a stray file for another (shards of other names)."""
    import json

    from ple_tools import bench_transformers as bench

    directory = tmp_path / "ckpt"
    info = bench.ensure_checkpoint(directory, 0.001 * 2**30, torch.bfloat16, ple_layers=2)
    marker = json.loads((directory / "ple_bench.json").read_text())
    assert marker["written_by"] == "ple-bench-transformers" and marker["complete"] is True
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [*marker["files"], "ple_bench.json"])
    assert len(marker["files"]) == 2 * 8 + 3
    written = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    assert bench.ensure_checkpoint(directory, 0.001 * 2**30, torch.bfloat16, ple_layers=2) == info
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == written
    bench.ensure_checkpoint(directory, 0.001 * 2**30, torch.bfloat16, ple_layers=1)
    marker = json.loads((directory / "ple_bench.json").read_text())
    assert len(marker["files"]) == 8 + 3
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [*marker["files"], "ple_bench.json"])
