"""Once ple.integrations.transformers serves a model, transformers' saving
refuses a directory its tables are served from (transformers would
overwrite model.safetensors and delete the shards it does not write
again), before writing anything, however it is called (the model's
method, the class's function, PreTrainedModel's unbound, a Trainer, for
this model or any other) and however the directory is named (a symlink,
``..``, a relative path, another working directory, a folder of links as
huggingface_hub's cache has), and never deletes nor overwrites a file a
table is served from; it saves elsewhere as before: the model without its
offloaded tables.  Copies refuse too, and nothing keeps the model alive
(it is freed, its tables closed, once dropped)."""

from __future__ import annotations

import copy
import functools
import gc
import io
import os
import shutil
import subprocess
import sys
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")

from safetensors import safe_open  # noqa: E402
from transformers import (Gemma3nForCausalLM, Gemma3nTextConfig, PreTrainedModel,  # noqa: E402
                          Qwen4ExpForCausalLM, Qwen4ExpTextConfig, Trainer, TrainingArguments)
from transformers import modeling_utils  # noqa: E402

from helpers import quiet_transformers  # noqa: E402, F401 (an autouse fixture)
from helpers import directory_bytes  # noqa: E402
from ple.integrations.transformers import close_tables, from_pretrained, tables  # noqa: E402

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


SAVE_ELSEWHERE = ("Save into another directory: a model that ple serves is saved without its "
                  "offloaded tables, so keep this checkpoint too")


def table_names(model) -> list[str]:
    return sorted({table.name for table in tables(model).values()})


def listed(names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{len(names)} ple table{'' if len(names) == 1 else 's'} ({shown})"


def refusal(directory, names: list[str]) -> str:
    return (f"save_pretrained: {directory} holds the files of {listed(names)}, which ple serves "
            "from there; transformers' save_pretrained would overwrite or delete them (it writes "
            "model.safetensors, and deletes the shards of an earlier save that it does not write "
            f"again). {SAVE_ELSEWHERE}")


def trainer_save(model, directory, **options):
    args = TrainingArguments(output_dir=str(directory), report_to=[], use_cpu=True)
    Trainer(model=model, args=args).save_model(str(directory))


# Every way a program reaches transformers' save_pretrained of a model.
ROUTES = {
    "model.save_pretrained": lambda model, directory, **options: model.save_pretrained(
        directory, **options),
    "the class's function": lambda model, directory, **options: type(model).save_pretrained(
        model, directory, **options),
    "PreTrainedModel.save_pretrained": lambda model, directory, **options:
        PreTrainedModel.save_pretrained(model, directory, **options),
    "a kept partial": lambda model, directory, **options: functools.partial(
        model.save_pretrained, directory)(**options),
    "Trainer.save_model": trainer_save,
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("checkpoint", sorted(MODELS), indirect=True)
def test_saving_into_the_tables_directory_is_refused_by_every_route(checkpoint, route):
    directory, model = checkpoint
    before = directory_bytes(directory)
    for safe_serialization in (True, False):
        with pytest.raises(ValueError) as error:
            ROUTES[route](model, directory, safe_serialization=safe_serialization)
        assert str(error.value) == refusal(directory, table_names(model))
    assert directory_bytes(directory) == before


@pytest.mark.parametrize("checkpoint", ["qwen4exp"], indirect=True)
def test_the_same_directory_by_another_path_is_refused(checkpoint, tmp_path, monkeypatch):
    """A symlink to the directory, the path with a ``..`` in it, and a
    relative path, by each route."""
    directory, model = checkpoint
    before = directory_bytes(directory)
    (tmp_path / "link").symlink_to(directory)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    for other in (tmp_path / "link", tmp_path / "sub" / ".." / "checkpoint", "../checkpoint",
                  "../link"):
        for route in ROUTES:
            with pytest.raises(ValueError) as error:
                ROUTES[route](model, other, max_shard_size="64KB")
            assert str(error.value) == refusal(other, table_names(model)), route
    assert directory_bytes(directory) == before


def test_after_chdir_the_served_checkpoint_is_refused_and_another_saved(saved, tmp_path,
                                                                        monkeypatch):
    """Loaded by a relative path, then the working directory changed to one
    that holds a copy of the checkpoint under the same name: the served
    checkpoint is refused by any name, the copy (which no table is served
    from) is saved into."""
    for name in ("first", "second"):
        shutil.copytree(saved["gemma3n"], tmp_path / name / "checkpoint")
    monkeypatch.chdir(tmp_path / "first")
    model = from_pretrained(Gemma3nForCausalLM, "checkpoint")
    served = tmp_path / "first" / "checkpoint"
    before = directory_bytes(served)
    os.chdir(tmp_path / "second")
    for other in (served, "../first/checkpoint"):
        for route in ROUTES:
            with pytest.raises(ValueError) as error:
                ROUTES[route](model, other)
            assert str(error.value) == refusal(other, table_names(model)), route
    assert directory_bytes(served) == before
    copy_before = directory_bytes(tmp_path / "second" / "checkpoint")
    PreTrainedModel.save_pretrained(model, "checkpoint")
    assert directory_bytes(tmp_path / "second" / "checkpoint") != copy_before


LOAD_AND_SAVE = """
import sys, torch, transformers
from transformers import PreTrainedModel
transformers.logging.set_verbosity_error()
model = torch.load(sys.argv[1], weights_only=False)
try:
    PreTrainedModel.save_pretrained(model, "../first/checkpoint")
except ValueError as error:
    print(error)
PreTrainedModel.save_pretrained(model, "checkpoint")
"""


def test_a_model_loaded_in_another_process_after_chdir_refuses_too(saved, tmp_path, monkeypatch):
    """torch.save of a model loaded by a relative path, after a chdir;
    torch.load in a new process (ple's guard comes with the model) that
    runs in the other directory: the served checkpoint is refused, the copy
    of the same name saved into."""
    for name in ("first", "second"):
        shutil.copytree(saved["gemma3n"], tmp_path / name / "checkpoint")
    monkeypatch.chdir(tmp_path / "first")
    model = from_pretrained(Gemma3nForCausalLM, "checkpoint")
    os.chdir(tmp_path / "second")
    torch.save(model, tmp_path / "model.pt")
    served = directory_bytes(tmp_path / "first" / "checkpoint")
    other = directory_bytes(tmp_path / "second" / "checkpoint")
    run = subprocess.run([sys.executable, "-c", LOAD_AND_SAVE, str(tmp_path / "model.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == refusal("../first/checkpoint", table_names(model))
    assert directory_bytes(tmp_path / "first" / "checkpoint") == served
    assert directory_bytes(tmp_path / "second" / "checkpoint") != other


def test_a_folder_of_links_is_refused_and_its_links_are_kept(saved, tmp_path):
    """The layout of huggingface_hub's cache: the checkpoint's files are
    links into a folder of blobs; the links' folder and the blobs' folder
    are both refused, and deleting or overwriting a link is too."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(saved["qwen4exp"], blobs)
    snapshot.mkdir()
    for file in blobs.iterdir():
        (snapshot / file.name).symlink_to(os.path.relpath(file, snapshot))
    model = from_pretrained(Qwen4ExpForCausalLM, snapshot)
    before = directory_bytes(blobs)
    links = {p.name: os.readlink(p) for p in snapshot.iterdir()}
    for directory in (snapshot, blobs):
        for route in ROUTES:
            with pytest.raises(ValueError) as error:
                ROUTES[route](model, directory, max_shard_size="64KB")
            assert str(error.value) == refusal(directory, table_names(model)), route
    assert directory_bytes(blobs) == before
    assert {p.name: os.readlink(p) for p in snapshot.iterdir()} == links


@pytest.mark.parametrize("checkpoint", ["qwen4exp"], indirect=True)
def test_transformers_neither_deletes_nor_overwrites_a_served_file(checkpoint, tmp_path):
    """The two calls with which transformers' save_pretrained destroys
    files, by any name of a served file, refuse it; other files they
    write and delete as before."""
    directory, model = checkpoint
    before = directory_bytes(directory)
    table = next(iter(tables(model).values()))
    served = table.paths[0]
    (tmp_path / "link.safetensors").symlink_to(served)
    names = sorted({t.name for t in tables(model).values() if served in t.paths})
    for path in (served, tmp_path / "link.safetensors"):
        with pytest.raises(ValueError) as error:
            modeling_utils.os.remove(path)
        assert str(error.value) == (
            f"save_pretrained: {path} is a file of {listed(names)}, which ple serves from it; "
            f"transformers was about to delete it. {SAVE_ELSEWHERE}")
        with pytest.raises(ValueError) as error:
            modeling_utils.safe_save_file({"x": torch.zeros(2)}, path)
        assert str(error.value) == (
            f"save_pretrained: {path} is a file of {listed(names)}, which ple serves from it; "
            f"transformers was about to overwrite it. {SAVE_ELSEWHERE}")
    assert directory_bytes(directory) == before
    other = tmp_path / "other.safetensors"
    modeling_utils.safe_save_file({"x": torch.zeros(2)}, other)
    modeling_utils.os.remove(other)
    assert not other.exists()


@pytest.mark.parametrize("checkpoint", ["gemma3n"], indirect=True)
def test_another_model_cannot_save_over_the_tables_either(checkpoint, saved, tmp_path):
    """A model that transformers alone loaded is refused the served
    checkpoint (its save would take the tables' files too) and saves
    anywhere else as with transformers alone."""
    directory, model = checkpoint
    before = directory_bytes(directory)
    plain = Gemma3nForCausalLM.from_pretrained(saved["gemma3n"])
    with pytest.raises(ValueError) as error:
        plain.save_pretrained(directory)
    assert str(error.value) == refusal(directory, table_names(model))
    assert directory_bytes(directory) == before
    plain.save_pretrained(tmp_path / "plain")
    with safe_open(tmp_path / "plain" / "model.safetensors", "pt") as f:
        assert "model.embed_tokens_per_layer.weight" in f.keys()


@pytest.mark.parametrize("checkpoint", ["qwen4exp"], indirect=True)
def test_a_model_whose_tables_are_closed_still_refuses(checkpoint):
    directory, model = checkpoint
    before = directory_bytes(directory)
    names = table_names(model)
    close_tables(model)
    with pytest.raises(ValueError) as error:
        PreTrainedModel.save_pretrained(model, directory)
    assert str(error.value) == refusal(directory, names)
    assert directory_bytes(directory) == before


def test_closed_tables_that_nothing_holds_refuse_no_longer(saved, tmp_path):
    """Once the model holding closed tables is dropped, no table is served
    from the checkpoint: another model saves into it."""
    directory = tmp_path / "checkpoint"
    shutil.copytree(saved["gemma3n"], directory)
    model = from_pretrained(Gemma3nForCausalLM, directory)
    close_tables(model)
    plain = Gemma3nForCausalLM.from_pretrained(saved["gemma3n"])
    with pytest.raises(ValueError):
        plain.save_pretrained(directory)
    del model
    gc.collect()
    plain.save_pretrained(directory)
    with safe_open(directory / "model.safetensors", "pt") as f:
        assert "model.embed_tokens_per_layer.weight" in f.keys()


class Wrapper(torch.nn.Module):
    """A model that is no PreTrainedModel: Trainer saves its state dict itself."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs)


@pytest.mark.parametrize("checkpoint", sorted(MODELS), indirect=True)
def test_a_trainer_of_a_wrapped_model_is_refused_the_served_checkpoint(checkpoint, tmp_path):
    directory, model = checkpoint
    before = directory_bytes(directory)
    args = TrainingArguments(output_dir=str(tmp_path / "runs"), report_to=[], use_cpu=True)
    trainer = Trainer(model=Wrapper(model), args=args)
    with pytest.raises(ValueError) as error:
        trainer.save_model(str(directory))
    assert str(error.value) == refusal(directory, table_names(model))
    assert directory_bytes(directory) == before
    trainer.save_model(str(tmp_path / "out"))
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(Wrapper(model).state_dict())


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
    names = table_names(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    for other in copies:
        assert type(other) is Qwen4ExpForCausalLM
        with pytest.raises(ValueError) as error:
            type(other).save_pretrained(other, directory)
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
