"""No table-sized allocation while vLLM builds and loads a model whose tables
ple serves (docs/vllm.md): every tensor made during vLLM's model
construction and load is recorded (tests/allocations.py: every op's
outputs, vLLM's parameters among them), and none that holds memory of its
own is as large as the table.  Gemma 3n through ``vllm.LLM`` (its loader's
``load_model``, in-process: construction, weights, their processing): the
text-only class, its table alone in a file or sharing the file with every
other tensor (the loader then hands the table over as a mapping of the file,
which is no allocation: its pages are never read, see test_vllm.py), and the
multimodal class, which builds the text-only one; Gemma 4's text-only and
multimodal classes (test_vllm_gemma4.py), given "auto" or the module's
name; Qwen4Exp's PLE
layers as vLLM builds them (vLLM's whole Qwen4Exp does not build on this
CPU, see test_vllm_qwen4_exp.py) and loads their n-gram modules.  The same
models with the tables in memory (``PLE_OFFLOAD=none``) show that the
recording sees vLLM's table.  The CUDA variants also record every block of
torch's CUDA allocator; they skip without a GPU.  Needs vLLM
(``make test-vllm``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
pytest.importorskip("transformers")

from allocations import cuda_allocations, recording  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from test_vllm import (MULTIMODAL_LLM, MULTIMODAL_TABLE, OTHERS_FILE, TABLE, TABLE_FILE,  # noqa: E402
                       TIMEOUT_S, session_results, write_checkpoint, write_multimodal_checkpoint)
from test_vllm_gemma4 import MULTIMODAL as GEMMA4_MULTIMODAL_LLM  # noqa: E402
from test_vllm_gemma4 import WITHOUT_TORCHVISION  # noqa: E402
from test_vllm_gemma4 import write_multimodal_checkpoint as write_gemma4_multimodal  # noqa: E402
from test_vllm_gemma4 import write_text_checkpoint as write_gemma4_text  # noqa: E402
from test_vllm_qwen4_exp import build_layers, checkpoint, vllm_config  # noqa: E402, F401

from helpers import REPO  # noqa: E402

needs_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The per-layer table 1024 x (4 layers x 64) float32: 1 MiB, four times the
# model's next largest tensor (embed_tokens, 1024 x 64).
PER_LAYER_INPUT = 64
TABLE_BYTES = 1024 * 4 * PER_LAYER_INPUT * 4

# One process, an engine per arm (in-process), each arm's PLE_OFFLOAD set
# before its engine is built.  vLLM's model loader records what its
# load_model makes (construction, weights, their processing), reports it and
# stops the engine there: its profile run and KV cache come after the load
# and are not the load's.
SESSION = r"""
import dataclasses, json, os, sys
from contextlib import nullcontext

class Recorded(Exception):
    pass

def main():
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, spec["tests"])
    from allocations import cuda_allocations, recording
    from test_vllm import build_gemma3n_without_vision_tower
    from test_vllm_gemma4 import build_processor_for_text_prompts
    from vllm import LLM
    from vllm.model_executor.model_loader import base_loader

    build_gemma3n_without_vision_tower()
    build_processor_for_text_prompts()
    load_model = base_loader.BaseModelLoader.load_model

    def recorded(loader, vllm_config, model_config, prefix=""):
        cuda = spec["device"] == "cuda"
        with cuda_allocations() if cuda else nullcontext([]) as blocks:
            with recording(spec["at_least"]) as recorder:
                model = load_model(loader, vllm_config, model_config, prefix)
        served = {name: module.table.name for name, module in model.named_modules()
                  if hasattr(module, "table")}
        raise Recorded({"made": [dataclasses.asdict(made) for made in recorder.made],
                        "cuda_blocks": [size for size in blocks if size >= spec["at_least"]],
                        "served": served})

    base_loader.BaseModelLoader.load_model = recorded
    for arm in spec["arms"]:
        os.environ["PLE_OFFLOAD"] = arm["offload"]
        try:
            LLM(model=arm["model"], dtype="float32", seed=0, max_model_len=128,
                max_num_batched_tokens=128, max_num_seqs=4, gpu_memory_utilization=0.1,
                enforce_eager=True, **spec["llm"][arm["kind"]])
        except Recorded as recorded_load:
            (result,) = recorded_load.args
        print("RESULT " + json.dumps({"name": arm["name"], **result}), flush=True)

main()
"""
# vLLM's options of each kind of model (see test_vllm.py, test_vllm_gemma4.py).
LLM_OPTIONS = {"text": {"skip_tokenizer_init": True}, "multimodal": MULTIMODAL_LLM,
               "gemma4-multimodal": GEMMA4_MULTIMODAL_LLM}


def load_recorded(arms: list[dict], device: str = "cpu") -> dict:
    """vLLM's load of each arm's model ("model", its "kind") with
    PLE_OFFLOAD=``arm["offload"]``, recorded: ``{arm name: result}``."""
    spec = {"arms": arms, "tests": str(REPO / "tests"), "device": device,
            "at_least": TABLE_BYTES, "llm": LLM_OPTIONS}
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **WITHOUT_TORCHVISION}
    directory = Path(arms[0]["model"]).parent.parent
    session = directory / "vllm_allocations_session.py"
    session.write_text(SESSION)
    done = subprocess.run([sys.executable, str(session), json.dumps(spec)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=environment, cwd=directory)
    results, _ = session_results(done, arms)
    return results


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory) -> dict[str, Path]:
    """The tiny Gemma 3n of test_vllm.py with a 1 MiB per-layer table: the
    text-only model, its table alone in a file ("text") or beside every
    other tensor in one file ("one-file"), and the multimodal one."""
    directory = tmp_path_factory.mktemp("gemma3n-allocations")
    text = write_checkpoint(directory / "text" / "model", hidden_size_per_layer_input=PER_LAYER_INPUT)
    one_file = directory / "one-file" / "model"
    one_file.mkdir(parents=True)
    tensors = {}
    for name in (OTHERS_FILE, TABLE_FILE):
        with safe_open(text / name, "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    save_file(tensors, str(one_file / "model.safetensors"), metadata={"format": "pt"})
    for file in text.glob("*.json"):
        if file.name != "model.safetensors.index.json":
            (one_file / file.name).write_text(file.read_text())
    multimodal = write_multimodal_checkpoint(directory / "multimodal" / "model",
                                             hidden_size_per_layer_input=PER_LAYER_INPUT)
    return {"text": text, "one-file": one_file, "multimodal": multimodal}


def gemma_arms(models: dict[str, Path]) -> list[dict]:
    names = "model.self_decoder.embed_tokens_per_layer"
    return [{"name": "auto", "model": str(models["text"]), "kind": "text", "offload": "auto"},
            {"name": "names", "model": str(models["text"]), "kind": "text", "offload": names},
            {"name": "one-file", "model": str(models["one-file"]), "kind": "text",
             "offload": "auto"},
            {"name": "multimodal", "model": str(models["multimodal"]), "kind": "multimodal",
             "offload": "auto"},
            {"name": "in-memory", "model": str(models["text"]), "kind": "text", "offload": "none"}]


@pytest.fixture(scope="module")
def gemma(gemma_models) -> dict:
    return load_recorded(gemma_arms(gemma_models))


def table_sized(result: dict, *, allocated: bool) -> list[dict]:
    return [made for made in result["made"] if (made["mapped_file"] is None) == allocated]


def assert_no_table_sized_allocation(result: dict, module: str, tensor: str = TABLE) -> None:
    assert result["served"] == {module: tensor}
    assert table_sized(result, allocated=True) == []
    assert result["cuda_blocks"] == []


@pytest.mark.parametrize("arm", ["auto", "names"])
def test_gemma_loads_without_a_table_sized_tensor(gemma, arm):
    assert_no_table_sized_allocation(gemma[arm], "model.self_decoder.embed_tokens_per_layer")
    assert table_sized(gemma[arm], allocated=False) == []  # its file is not even opened


def test_gemma_in_one_file_loads_without_a_table_sized_allocation(gemma, gemma_models):
    """vLLM's loader hands the table over (the model's load_weights leaves
    it) as a tensor over the file's mapping, not memory of its own."""
    assert_no_table_sized_allocation(gemma["one-file"], "model.self_decoder.embed_tokens_per_layer")
    mapped = table_sized(gemma["one-file"], allocated=False)
    assert mapped and {made["mapped_file"] for made in mapped} == {
        str(gemma_models["one-file"] / "model.safetensors")}


def test_multimodal_gemma_loads_without_a_table_sized_tensor(gemma):
    assert_no_table_sized_allocation(gemma["multimodal"],
                                     "language_model.model.self_decoder.embed_tokens_per_layer",
                                     MULTIMODAL_TABLE)


def test_the_recording_sees_vllms_table_in_memory(gemma):
    """PLE_OFFLOAD=none: ple's class, vLLM's table in memory, its parameter
    recorded as it is made."""
    assert gemma["in-memory"]["served"] == {}
    assert {"op": "aten.empty.memory_format", "shape": [1024, 4 * PER_LAYER_INPUT],
            "dtype": "torch.float32", "device": "cpu", "nbytes": TABLE_BYTES,
            "mapped_file": None} in gemma["in-memory"]["made"]


@needs_a_gpu
def test_gemma_loads_without_a_table_sized_tensor_on_cuda(gemma_models):
    results = load_recorded(gemma_arms(gemma_models), device="cuda")
    for arm in ("auto", "names", "one-file"):
        assert_no_table_sized_allocation(results[arm], "model.self_decoder.embed_tokens_per_layer")
    assert_no_table_sized_allocation(results["multimodal"],
                                     "language_model.model.self_decoder.embed_tokens_per_layer",
                                     MULTIMODAL_TABLE)
    assert max(results["in-memory"]["cuda_blocks"]) >= TABLE_BYTES
    assert any(made["shape"] == [1024, 4 * PER_LAYER_INPUT] and made["device"].startswith("cuda")
               for made in results["in-memory"]["made"])


@pytest.fixture(scope="module")
def gemma4_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Gemma 4 (test_vllm_gemma4.py) with a 1 MiB per-layer
    table alone in a file: a text checkpoint and the published multimodal
    layout."""
    directory = tmp_path_factory.mktemp("gemma4-allocations")
    return {"text": write_gemma4_text(directory / "text" / "model",
                                      hidden_size_per_layer_input=PER_LAYER_INPUT),
            "multimodal": write_gemma4_multimodal(directory / "multimodal" / "model",
                                                  hidden_size_per_layer_input=PER_LAYER_INPUT)}


def gemma4_arms(models: dict[str, Path]) -> list[dict]:
    """Each class offloaded by "auto" and by the module's name (the
    multimodal class given the text-only class's name), and each with the
    table in memory."""
    text, multimodal = str(models["text"]), str(models["multimodal"])
    name = "model.embed_tokens_per_layer"
    return [{"name": "auto", "model": text, "kind": "text", "offload": "auto"},
            {"name": "names", "model": text, "kind": "text", "offload": name},
            {"name": "multimodal", "model": multimodal, "kind": "gemma4-multimodal",
             "offload": "auto"},
            {"name": "multimodal-names", "model": multimodal, "kind": "gemma4-multimodal",
             "offload": name},
            {"name": "in-memory", "model": text, "kind": "text", "offload": "none"},
            {"name": "multimodal-in-memory", "model": multimodal, "kind": "gemma4-multimodal",
             "offload": "none"}]


@pytest.fixture(scope="module")
def gemma4(gemma4_models) -> dict:
    return load_recorded(gemma4_arms(gemma4_models))


def assert_gemma4_loads_without_a_table_sized_tensor(results: dict) -> None:
    for arm in ("auto", "names"):
        assert_no_table_sized_allocation(results[arm], "model.embed_tokens_per_layer")
        assert table_sized(results[arm], allocated=False) == []  # its file is not even opened
    for arm in ("multimodal", "multimodal-names"):
        assert_no_table_sized_allocation(results[arm],
                                         "language_model.model.embed_tokens_per_layer",
                                         MULTIMODAL_TABLE)


def test_gemma4_loads_without_a_table_sized_tensor(gemma4):
    assert_gemma4_loads_without_a_table_sized_tensor(gemma4)


@pytest.mark.parametrize("arm", ["in-memory", "multimodal-in-memory"])
def test_the_recording_sees_vllms_gemma4_table_in_memory(gemma4, arm):
    assert gemma4[arm]["served"] == {}
    assert {"op": "aten.empty.memory_format", "shape": [1024, 4 * PER_LAYER_INPUT],
            "dtype": "torch.float32", "device": "cpu", "nbytes": TABLE_BYTES,
            "mapped_file": None} in gemma4[arm]["made"]


@needs_a_gpu
def test_gemma4_loads_without_a_table_sized_tensor_on_cuda(gemma4_models):
    results = load_recorded(gemma4_arms(gemma4_models), device="cuda")
    assert_gemma4_loads_without_a_table_sized_tensor(results)
    for arm in ("in-memory", "multimodal-in-memory"):
        assert max(results[arm]["cuda_blocks"]) >= TABLE_BYTES
        assert any(made["shape"] == [1024, 4 * PER_LAYER_INPUT]
                   and made["device"].startswith("cuda") for made in results[arm]["made"])


def ngram_table_bytes(directory: Path, written: dict) -> int:
    """The bytes of the smallest of the checkpoint's n-gram tables, its
    shards together, as stored (as vLLM holds them)."""
    tables: dict[str, int] = {}
    for name in written["table_files"]:
        layer = name.split("-")[2]  # model-ngram-{layer}-{shard}.safetensors
        with safe_open(directory / name, "pt") as f:
            tables[layer] = tables.get(layer, 0) + sum(f.get_tensor(key).nbytes
                                                       for key in f.keys())  # noqa: SIM118
    return min(tables.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_a_gpu)])
def test_qwen4exp_ple_layers_load_without_a_table_sized_tensor(checkpoint, vllm_config,
                                                                monkeypatch, device):
    """vLLM's PLE layers built (on ``device``, as vLLM's loader builds its
    model) and loaded with ple's n-gram modules: no allocation of a table's
    size.  With the tables in memory (``none``), vLLM's table is recorded."""
    directory, config, written = checkpoint
    table_bytes = ngram_table_bytes(directory, written)
    made = {}
    for offload in ("auto", "none"):
        with torch.device(device), cuda_allocations() if device == "cuda" else nullcontext(
                []) as blocks, recording(table_bytes) as recorder:
            tables, _ = build_layers(config, vllm_config, directory, written, offload,
                                     monkeypatch)
        made[offload] = (recorder.allocated(), [size for size in blocks if size >= table_bytes])
        assert len(tables.served) == (2 if offload == "auto" else 0)
    assert made["auto"] == ([], [])
    in_memory, blocks = made["none"]
    assert {(m.op, m.device.split(":")[0]) for m in in_memory} >= {
        ("aten.empty.memory_format", device)}
    assert device == "cpu" or max(blocks) >= table_bytes
