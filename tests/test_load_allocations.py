"""No table-sized tensor while ple's transformers integration loads a model
(docs/transformers.md): every tensor made during
``from_pretrained(..., offload="auto")`` is recorded (tests/allocations.py:
every op's outputs, on the loading thread and on the pool of threads
transformers materializes tensors on), and none is as large as a table,
neither memory of its own nor a mapping of the checkpoint's file;
transformers' own ``from_pretrained`` of the same checkpoint is recorded
making the table (in memory of its own, or over the file's mapping, whose
pages its forwards read).  Tiny Gemma 3n and Qwen4Exp whose tables are their largest
tensors."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")

from safetensors import safe_open  # noqa: E402
from transformers import (Gemma3nForCausalLM, Gemma3nTextConfig, Qwen4ExpForCausalLM,  # noqa: E402
                          Qwen4ExpTextConfig)

from allocations import recording  # noqa: E402
from helpers import quiet_transformers  # noqa: E402, F401 (an autouse fixture)
from ple.integrations.transformers import close_tables, from_pretrained  # noqa: E402
from test_transformers_integration import GEMMA_CONFIG, QWEN_CONFIG  # noqa: E402

# Gemma 3n's per-layer table, 256 x (4 layers x 64) float32 (256 KiB), is
# four times its next largest tensor (embed_tokens, 256 x 64); Qwen4Exp's
# n-gram tables, of about 20,000 rows, outgrow its other tensors.
GEMMA_CONFIG = {**GEMMA_CONFIG, "vocab_size_per_layer_input": 256,
                "hidden_size_per_layer_input": 64}
MODELS = {
    "gemma3n": (Gemma3nForCausalLM, Gemma3nTextConfig(**GEMMA_CONFIG), "embed_tokens_per_layer"),
    "qwen4exp": (Qwen4ExpForCausalLM, Qwen4ExpTextConfig(**{**QWEN_CONFIG,
                                                            "ngram_vocab_size_base": 20_000}),
                 "ngram_embedding"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    """(model class, directory, the bytes of its smallest table)."""
    model_class, config, table = MODELS[request.param]
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp(request.param)
    model_class(config).save_pretrained(directory)
    nbytes = {}  # of each tensor of the checkpoint
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            nbytes.update({key: f.get_tensor(key).nbytes for key in f.keys()})  # noqa: SIM118
    # Each table's tensors (a Qwen4Exp table's shards) by the table's name.
    tables: dict[str, int] = {}
    for name, n in nbytes.items():
        if table in name and name.endswith(".weight"):
            whole = name.rsplit(".shard_", 1)[0].removesuffix(".weight")
            tables[whole] = tables.get(whole, 0) + n
    others = [n for name, n in nbytes.items() if table not in name]
    assert min(tables.values()) > 2 * max(others)
    return model_class, directory, min(tables.values())


def test_ple_loads_without_a_table_sized_tensor(checkpoint):
    model_class, directory, table_bytes = checkpoint
    with recording(table_bytes) as recorder:
        model = from_pretrained(model_class, directory, offload="auto")
    try:
        assert model.ple_offloaded
        assert recorder.made == []
    finally:
        close_tables(model)


def test_the_recording_sees_transformers_table(checkpoint):
    model_class, directory, table_bytes = checkpoint
    with recording(table_bytes) as recorder:
        model_class.from_pretrained(directory)
    assert recorder.made  # memory of its own or the file's mapping, as transformers goes
