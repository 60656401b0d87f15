"""A model that ple.integrations.transformers serves is saved whole, by
every route a program takes (transformers' save_pretrained however it is
called, a Trainer, accelerate's save_model, safetensors or torch.save of its
state dict): its tables go into the new checkpoint as the served files hold
them, streamed from those files (no table-sized tensor is made), and the new
folder loads with and without ple to the same logits.  Saving into the
served checkpoint itself replaces its files (each written beside the old one
and renamed: a file the process maps is never truncated), and the served
model goes on serving the same rows from the files it mapped.  Copies save
whole too, and nothing keeps the model alive."""

from __future__ import annotations

import copy
import functools
import gc
import io
import os
import shutil
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")

import safetensors.torch  # noqa: E402
from transformers import (Gemma3nForCausalLM, Gemma3nTextConfig, PreTrainedModel,  # noqa: E402
                          Qwen4ExpForCausalLM, Qwen4ExpTextConfig, Trainer, TrainingArguments)

from allocations import recording  # noqa: E402
from helpers import quiet_transformers  # noqa: E402, F401 (an autouse fixture)
from helpers import assert_same_bits  # noqa: E402
from ple.integrations.transformers import close_tables, from_pretrained, tables  # noqa: E402

from test_transformers_integration import GEMMA_CONFIG, QWEN_CONFIG  # noqa: E402

# Qwen4Exp in shards (transformers deletes the ones it does not write
# again), Gemma 3n in one model.safetensors (transformers overwrites it).
MODELS = {"qwen4exp": (Qwen4ExpForCausalLM, Qwen4ExpTextConfig, QWEN_CONFIG,
                       {"max_shard_size": "64KB"}),
          "gemma3n": (Gemma3nForCausalLM, Gemma3nTextConfig, GEMMA_CONFIG, {})}
PROMPT = torch.tensor([[5, 17, 3, 99, 42, 8, 61, 23, 7, 2, 88, 14]])


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
    """A copy of a saved model's directory, the model loaded from it, and its
    logits for PROMPT."""
    key = request.param
    directory = tmp_path / "checkpoint"
    shutil.copytree(saved[key], directory)
    model = from_pretrained(MODELS[key][0], directory)
    assert tables(model)
    yield directory, model, logits(model)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits


def trainer_save(model, directory, **options):
    args = TrainingArguments(output_dir=str(directory), report_to=[], use_cpu=True)
    Trainer(model=model, args=args).save_model(str(directory))


def accelerate_save(model, directory, **options):
    """accelerate's save_model (the weights alone), beside the model's config."""
    from accelerate import Accelerator

    Accelerator(cpu=True).save_model(model, directory, **options)
    model.config.save_pretrained(directory)


def state_dict_save_file(model, directory, **options):
    """safetensors' save_file of the state dict, beside the model's config."""
    os.makedirs(directory, exist_ok=True)
    model.config.save_pretrained(directory)
    safetensors.torch.save_file(model.state_dict(), os.path.join(directory, "model.safetensors"),
                                metadata={"format": "pt"})


# Every way a program saves a transformers model into a folder that loads.
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
    "Accelerator.save_model": lambda model, directory, **options: accelerate_save(
        model, directory, max_shard_size=options.get("max_shard_size", "10GB")),
    "safetensors.save_file(state_dict)": state_dict_save_file,
}

# The routes that write one model.safetensors whatever the checkpoint's shards.
ONE_FILE_ROUTES = ("Trainer.save_model", "safetensors.save_file(state_dict)")


def assert_loads_whole(key: str, directory, want: torch.Tensor) -> None:
    """The folder loads with transformers alone and through ple to ``want``."""
    model_class = MODELS[key][0]
    assert_same_bits(logits(model_class.from_pretrained(directory)), want)
    served = from_pretrained(model_class, directory)
    try:
        assert tables(served)
        assert_same_bits(logits(served), want)
    finally:
        close_tables(served)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("checkpoint", sorted(MODELS), indirect=True)
def test_every_route_saves_the_whole_model(checkpoint, route, tmp_path):
    directory, model, want = checkpoint
    ROUTES[route](model, tmp_path / "out", **MODELS[next(
        k for k in MODELS if isinstance(model, MODELS[k][0]))][3])
    assert_loads_whole(next(k for k in MODELS if isinstance(model, MODELS[k][0])),
                       tmp_path / "out", want)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("checkpoint", sorted(MODELS), indirect=True)
def test_saving_into_the_served_checkpoint_replaces_it_whole(checkpoint, route):
    """The served model's files are replaced, never truncated: it goes on
    serving the same rows from the files it mapped, and the folder then
    holds the whole model."""
    directory, model, want = checkpoint
    key = next(k for k in MODELS if isinstance(model, MODELS[k][0]))
    if key == "qwen4exp" and route in ONE_FILE_ROUTES:
        pytest.skip("it writes one model.safetensors beside the sharded checkpoint's index, "
                    "as with transformers alone")
    served_ids = {name: list(table.file_ids) for name, table in tables(model).items()}
    ROUTES[route](model, directory, **MODELS[key][3])
    assert_same_bits(logits(model), want)
    assert {name: list(t.file_ids) for name, t in tables(model).items()} == served_ids
    assert_loads_whole(key, directory, want)
    assert not list(directory.glob(".*.tmp"))


@pytest.mark.parametrize("checkpoint", ["gemma3n"], indirect=True)
def test_torch_save_of_the_state_dict_is_whole(checkpoint, tmp_path):
    """torch.save of the state dict, also over the served file itself;
    transformers alone loads it into the model."""
    directory, model, want = checkpoint
    served_file = directory / "model.safetensors"
    for path in (tmp_path / "state.pt", served_file):
        torch.save(model.state_dict(), path)
        assert_same_bits(logits(model), want)
        plain = Gemma3nForCausalLM(model.config)
        with open(path, "rb") as f:  # torch.load would take a *.safetensors name for safetensors
            plain.load_state_dict(torch.load(f, weights_only=True))
        assert_same_bits(logits(plain), want)


@pytest.mark.parametrize("checkpoint", sorted(MODELS), indirect=True)
def test_saving_streams_the_tables_from_their_files(checkpoint, tmp_path):
    """No tensor of a table's (or a shard's) shape is made while the model is
    saved: the state dict's tables are mappings of the served files."""
    directory, model, want = checkpoint
    key = next(k for k in MODELS if isinstance(model, MODELS[k][0]))
    shapes = {(rows, table.cols) for table in tables(model).values()
              for rows in (table.num_rows, *table.shard_rows)}
    for route in ("model.save_pretrained", "safetensors.save_file(state_dict)"):
        with recording(1) as made:
            ROUTES[route](model, tmp_path / route, **MODELS[key][3])
        assert [m for m in made.made if m.allocated and m.shape in shapes] == [], route
        assert [m for m in made.made if m.shape in shapes], "the recording saw no table"
        assert_loads_whole(key, tmp_path / route, want)


def test_a_folder_of_links_is_saved_into_and_its_blobs_are_kept(saved, tmp_path):
    """The layout of huggingface_hub's cache: the checkpoint's files are
    links into a folder of blobs.  Saving into the links' folder replaces
    the links of the served files with the new files; their blobs stay as
    they were.  (transformers writes its JSON files through the links, into
    the blobs, as it does without ple.)"""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(saved["qwen4exp"], blobs)
    snapshot.mkdir()
    for file in blobs.iterdir():
        (snapshot / file.name).symlink_to(os.path.relpath(file, snapshot))
    model = from_pretrained(Qwen4ExpForCausalLM, snapshot)
    want = logits(model)
    before = {p.name: p.read_bytes() for p in blobs.glob("*.safetensors")}
    model.save_pretrained(snapshot, max_shard_size="64KB")
    assert {p.name: p.read_bytes() for p in blobs.glob("*.safetensors")} == before
    assert_same_bits(logits(model), want)
    assert_loads_whole("qwen4exp", snapshot, want)


@pytest.mark.parametrize("checkpoint", ["qwen4exp"], indirect=True)
def test_a_model_whose_tables_are_closed_says_so(checkpoint, tmp_path):
    directory, model, _ = checkpoint
    close_tables(model)
    with pytest.raises(ValueError, match="closed"):
        model.save_pretrained(tmp_path / "out")


class Wrapper(torch.nn.Module):
    """A model that is no PreTrainedModel: Trainer saves its state dict itself."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs)


@pytest.mark.parametrize("checkpoint", sorted(MODELS), indirect=True)
def test_a_trainer_of_a_wrapped_model_saves_its_tables(checkpoint, tmp_path):
    directory, model, _ = checkpoint
    args = TrainingArguments(output_dir=str(tmp_path / "runs"), report_to=[], use_cpu=True)
    trainer = Trainer(model=Wrapper(model), args=args)
    for out in (tmp_path / "out", directory):
        trainer.save_model(str(out))
        saved = safetensors.torch.load_file(out / "model.safetensors")
        state = Wrapper(model).state_dict()
        assert set(saved) == set(state)
        for key, tensor in state.items():
            assert_same_bits(saved[key], tensor)


def test_copies_save_whole_and_nothing_keeps_the_model_alive(saved, tmp_path):
    directory = tmp_path / "checkpoint"
    shutil.copytree(saved["qwen4exp"], directory)
    model = from_pretrained(Qwen4ExpForCausalLM, directory)
    want = logits(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    for n, other in enumerate(copies):
        assert type(other) is Qwen4ExpForCausalLM
        other.save_pretrained(tmp_path / f"out{n}", max_shard_size="64KB")
        assert_loads_whole("qwen4exp", tmp_path / f"out{n}", want)
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
