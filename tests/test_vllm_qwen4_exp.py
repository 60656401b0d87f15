"""Qwen4Exp's n-gram tables served by ple inside vLLM
(ple.integrations.vllm.qwen4_exp, docs/vllm.md), per module on the CPU: a
tiny random Qwen4Exp n-gram table (two PLE layers, FP8 with its scale and
bf16, several shards in files of their own, the text and the published
multimodal layouts) saved as transformers saves it; vLLM's own PLE layer with
the table in memory against the same layer whose n-gram module ple built:
ids, rows and the layer's output equal to the byte; the table's bytes never
read at load; PLE_OFFLOAD's choice of tables.

vLLM's whole Qwen4Exp does not build on this CPU (its multimodal parts import
torchvision, which fails beside the CPU torch; its gate and convolution are
Triton kernels): the PLE layer is built alone, its gate replaced here by a
torch transcription of vLLM's kernel, and its convolution is the no-op vLLM
runs without attention metadata.  Needs vLLM (``make test-vllm``)."""

from __future__ import annotations

import gc
import json
import logging
import os
import types

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
vllm_ple_layer = pytest.importorskip("vllm.models.qwen4_exp.nvidia.ple_layer")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen4ExpTextConfig  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,  # noqa: E402
                              init_distributed_environment, initialize_model_parallel)
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator  # noqa: E402

from helpers import PAGE, resident_pages  # noqa: E402
from ple.integrations.vllm import ARCHITECTURES, register  # noqa: E402
from ple.integrations.vllm.qwen4_exp import NGramTables, Qwen4ExpNGramEmbedding  # noqa: E402

# Decoder layers 1 and 2 (1-based 2 and 3) have PLE: the second hashes with
# PLE layer index 1 (its primes follow the first's).  4 heads of 8 values;
# each table has 4 primes near 20,000 rows, padded to 64, in 3 shards.
QWEN_CONFIG = dict(
    vocab_size=1000, hidden_size=16, hc_count=2, num_hidden_layers=4, ple_layer_ids=[2, 3],
    ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=20_000,
    make_ngram_vocab_size_divisible_by=64, split_ngram_parts=3, ple_embed_dim=32,
    eos_token_id=7, seed=1234)
PLE_LAYERS = {1: 0, 2: 1}  # decoder layer: PLE layer index
CONSTANTS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
LAYOUTS = {"text": "model.layers.{layer}", "published": "model.language_model.layers.{layer}"}
# Several requests back to back, with EOS (7) inside, after a context holding
# EOS, a request continuing from its context, and two unused request slots
# (vLLM's zero-length requests) with padding tokens after the last boundary.
TOKENS = [5, 17, 7, 99, 3, 999, 45, 7, 7, 12, 300, 301, 7, 302, 2, 8, 8, 1, 4]
QUERY_START_LOC = [0, 6, 7, 13, 16, 16, 16]
CONTEXT = [[7, 7], [3, 7], [250, 251], [7, 40], [7, 7], [7, 7]]


def gate_reference(key, value, hidden, norm_key_w, norm_query_w, norm_conv_w, eps):
    """vLLM's Triton PLE gate (``_ple_gate_kernel``) in torch, rounding where
    the kernel rounds: per token and stream, the normed key and query's
    scaled dot product gates the value; the gated value and its norm."""
    dtype = hidden.dtype
    size = value.shape[-1]
    streams = hidden.shape[-1] // size

    def normed(x, weight):
        x = x.float()
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True) / size + eps) * (1 + weight.float())

    k = key.reshape(-1, streams, size)
    q = hidden.reshape(-1, streams, size)
    k_n = normed(k, norm_key_w.reshape(streams, size)).to(dtype)
    q_n = normed(q, norm_query_w.reshape(streams, size)).to(dtype)
    products = (k_n.float() * q_n.float()).to(dtype)
    dot = products.float().sum(-1, keepdim=True).to(dtype).float()
    d = (dot / size ** 0.5).to(dtype).float()
    magnitude = torch.sqrt(d.abs().clamp_min(1e-6)).to(dtype).float()
    g = torch.sigmoid(torch.sign(d) * magnitude).to(dtype).float()
    gated = (g * value.float().unsqueeze(1)).to(dtype)
    norm = normed(gated, norm_conv_w.reshape(streams, size)).to(dtype)
    return gated.reshape(hidden.shape), norm.reshape(hidden.shape)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """A vLLM config current for the module's tests, vLLM's parallel groups
    of one rank, and the model fields the PLE layer reads."""
    config = VllmConfig()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"file://{tmp_path_factory.mktemp('dist') / 'init'}")
        initialize_model_parallel(1, 1)
        config.model_config = types.SimpleNamespace(dtype=torch.bfloat16, model=None,
                                                    revision=None)
        yield config
        destroy_model_parallel()
        destroy_distributed_environment()


def text_config(fp8: bool) -> Qwen4ExpTextConfig:
    return Qwen4ExpTextConfig(**QWEN_CONFIG, **({"ple_embedding_dtype": "float8_e4m3fn"} if fp8
                                                 else {}))


def vllm_layer(config, vllm_config, layer: int):
    """vLLM's PLE layer of decoder layer ``layer`` (its static context name freed first)."""
    prefix = f"model.layers.{layer}.ple"
    vllm_config.compilation_config.static_forward_context.pop(prefix, None)
    return vllm_ple_layer.Qwen4ExpPLELayer(config, vllm_config, layer_idx=layer,
                                           ple_dense_layer_id=PLE_LAYERS[layer], prefix=prefix)


def write_checkpoint(directory, config, vllm_config, layout: str, seed: int = 0) -> dict:
    """The n-gram tables of vLLM's PLE layers (random rows; FP8 with a
    scale) saved as transformers saves them: each shard in a file of its
    own, the scale and the hashing constants in another; flushed to the
    disk.  Returns the layers' other weights, ``{layer: state dict}``."""
    torch.manual_seed(seed)
    fp8 = getattr(config, "ple_embedding_dtype", None) == "float8_e4m3fn"
    small, others = {}, {}
    names = []
    for layer in PLE_LAYERS:
        module = vllm_layer(config, vllm_config, layer)
        table = module.ple_embedding.ngram_embedding.weight
        prefix = f"{LAYOUTS[layout].format(layer=layer)}.ple.ple_embedding"
        rows = torch.randn(table.shape)
        values = (rows * 40).clamp(-448, 448).to(torch.float8_e4m3fn) if fp8 else rows.bfloat16()
        parts = config.split_ngram_parts
        shard_rows = -(-table.shape[0] // parts)
        for j in range(parts):
            name = f"model-ngram-{layer}-{j}.safetensors"
            save_file({f"{prefix}.ngram_embedding.shard_{j}.weight":
                       values[j * shard_rows:(j + 1) * shard_rows].contiguous()},
                      str(directory / name), metadata={"format": "pt"})
            names.append(name)
        if fp8:
            small[f"{prefix}.ngram_embedding.weight_scale"] = torch.tensor([0.0137], dtype=torch.float32)
        for buffer in CONSTANTS:
            small[f"{prefix}.{buffer}"] = getattr(module.ple_embedding, buffer).clone()
        weights = {name: torch.randn(p.shape).to(p.dtype) for name, p in module.named_parameters()
                   if not name.startswith("ple_embedding.")}
        others[layer] = weights
    save_file(small, str(directory / "model-constants.safetensors"), metadata={"format": "pt"})
    weight_map = {}
    for name in [*names, "model-constants.safetensors"]:
        with safe_open(directory / name, "pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), name))  # noqa: SIM118
        fd = os.open(directory / name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {"weights": others, "table_files": names, "layout": layout}


def drop_pages(vllm_config, paths) -> None:
    """Drops the files' pages from the page cache, once no earlier layer
    maps them (vLLM's static forward context holds the layers it built)."""
    for layer in PLE_LAYERS:
        vllm_config.compilation_config.static_forward_context.pop(f"model.layers.{layer}.ple",
                                                                  None)
    gc.collect()
    for path in paths:
        _drop_file_pages(path)


def _drop_file_pages(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load_ngram_module(module, directory, layer: int, layout: str) -> None:
    """The n-gram module's tensors handed over by vLLM's lazy safetensors
    iterator (as vLLM's loader does), under the module's own names."""
    prefix = f"{LAYOUTS[layout].format(layer=layer)}.ple.ple_embedding."
    files = sorted(str(p) for p in directory.glob("*.safetensors"))
    weights = safetensors_weights_iterator(files, False, "lazy")
    module.load_weights((name.removeprefix(prefix), tensor) for name, tensor in weights
                        if name.startswith(prefix))


@pytest.fixture(scope="module", params=[("fp8", "published"), ("bf16", "text")],
                ids=["fp8-published", "bf16-text"])
def checkpoint(request, tmp_path_factory, vllm_config):
    kind, layout = request.param
    directory = tmp_path_factory.mktemp(f"qwen4exp-{kind}")
    config = text_config(kind == "fp8")
    return directory, config, write_checkpoint(directory, config, vllm_config, layout)


def build_layers(config, vllm_config, directory, written, environ, monkeypatch):
    """vLLM's PLE layers built under ple's NGramTables with PLE_OFFLOAD
    ``environ`` over ``directory``; their other weights set, their n-gram
    modules loaded, their quantization methods' processing after loading
    run.  Returns (tables, {layer: PLE layer})."""
    monkeypatch.setenv("PLE_OFFLOAD", environ)
    monkeypatch.setattr(vllm_config.model_config, "model", str(directory))
    tables = NGramTables(vllm_config)
    with tables.building(vllm_ple_layer):
        layers = {layer: vllm_layer(config, vllm_config, layer) for layer in PLE_LAYERS}
    for layer, module in layers.items():
        module.load_state_dict(written["weights"][layer], strict=False)
        load_ngram_module(module.ple_embedding, directory, layer, written["layout"])
        for part in module.modules():  # as vLLM's loader finishes each module
            if hasattr(part, "quant_method"):
                part.quant_method.process_weights_after_loading(part)
    return tables, layers


def batch():
    return (torch.tensor(TOKENS), torch.tensor(QUERY_START_LOC, dtype=torch.int32),
            torch.tensor(CONTEXT, dtype=torch.int32))


def test_ple_serves_the_layers_as_vllm_does_to_the_byte(checkpoint, vllm_config, monkeypatch):
    directory, config, written = checkpoint
    _, ours = build_layers(config, vllm_config, directory, written, "auto", monkeypatch)
    _, theirs = build_layers(config, vllm_config, directory, written, "none", monkeypatch)
    monkeypatch.setattr(vllm_ple_layer, "ple_gate", gate_reference)
    tokens, query_start_loc, context = batch()
    torch.manual_seed(1)
    hidden = torch.randn(len(TOKENS), config.hidden_size * config.hc_count).bfloat16()
    for layer in PLE_LAYERS:
        mine, vllms = ours[layer], theirs[layer]
        assert isinstance(mine.ple_embedding, Qwen4ExpNGramEmbedding)
        assert not isinstance(vllms.ple_embedding, Qwen4ExpNGramEmbedding)
        ids = vllms.ple_embedding.compute_ngram_ids(tokens, query_start_loc, context)
        assert torch.equal(mine.ple_embedding.compute_ngram_ids(tokens, query_start_loc, context),
                           ids)
        assert ids.unique().numel() > 0.9 * ids.numel()  # the rows differ: a real check
        rows = {}
        for name, module in (("ple", mine), ("vllm", vllms)):
            stored = module.ple_embedding(hidden, tokens, query_start_loc, context)
            rows[name] = module._dequantize_embeddings(stored, hidden.dtype)
        assert rows["ple"].dtype == rows["vllm"].dtype == torch.bfloat16
        assert torch.equal(rows["ple"].view(torch.int16), rows["vllm"].view(torch.int16))
        outputs = {}
        for name, module in (("ple", mine), ("vllm", vllms)):
            with set_forward_context(None, vllm_config):
                outputs[name] = module(hidden.clone(), tokens, query_start_loc, context)
        assert torch.equal(outputs["ple"].view(torch.int16), outputs["vllm"].view(torch.int16))
        assert mine.ple_embedding.ngram_embedding.table.stats()["rows"] > 0  # through ple


def test_fp8_rows_are_bf16_values_times_the_bf16_scale(checkpoint, vllm_config, monkeypatch):
    """ple's FP8 rows are vLLM's arithmetic, bf16(values) * bf16(scale),
    which differs from the float32 product rounded once: the byte equality
    above tells them apart."""
    directory, config, written = checkpoint
    if getattr(config, "ple_embedding_dtype", None) != "float8_e4m3fn":
        pytest.skip("an unscaled table")
    tables, _ = build_layers(config, vllm_config, directory, written, "auto", monkeypatch)
    table = next(iter(tables.served.values())).table
    ids = torch.arange(0, table.num_rows, 97)
    values = torch.ops.ple.disk_gather_bytes(ids, table.handle).view(torch.float8_e4m3fn)
    scale = torch.tensor(0.0137, dtype=torch.float32)
    vllms = values.to(torch.bfloat16) * scale.to(torch.bfloat16)
    gathered = torch.ops.ple.disk_gather(ids, table.handle, torch.bfloat16, True)
    assert torch.equal(gathered.view(torch.int16), vllms.view(torch.int16))
    assert not torch.equal(vllms, (values.float() * scale).to(torch.bfloat16))


def test_the_table_is_never_read_at_load(checkpoint, vllm_config, monkeypatch):
    """ple's module takes the table's tensors from vLLM's lazy iterator
    unread: each shard file holds its header's pages at most (and the
    kernel's readahead around them), no row gathered; vLLM's own module
    reads every page."""
    directory, config, written = checkpoint
    files = [directory / name for name in written["table_files"]]
    pages = [-(-path.stat().st_size // PAGE) for path in files]
    assert min(pages) > 16
    drop_pages(vllm_config, files)
    tables, _ = build_layers(config, vllm_config, directory, written, "auto", monkeypatch)
    resident = [resident_pages(path) for path in files]
    assert max(resident) <= 8, resident
    for embedding in tables.served.values():
        assert embedding.table.stats()["rows"] == 0
    drop_pages(vllm_config, files)
    build_layers(config, vllm_config, directory, written, "none", monkeypatch)
    assert [resident_pages(path) for path in files] == pages


def test_offload_auto_and_names_choose_the_tables(checkpoint, vllm_config, monkeypatch, caplog):
    directory, config, written = checkpoint
    caplog.set_level(logging.INFO, logger="vllm.plugins.ple")
    logging.getLogger("vllm.plugins.ple").addHandler(caplog.handler)
    try:
        tables, layers = build_layers(config, vllm_config, directory, written, "auto",
                                      monkeypatch)
    finally:
        logging.getLogger("vllm.plugins.ple").removeHandler(caplog.handler)
    names = [f"model.layers.{layer}.ple.ple_embedding.ngram_embedding" for layer in PLE_LAYERS]
    assert list(tables.served) == names
    table = tables.served[names[0]].table
    fmt, value_bytes = ("fp8_e4m3fn", 1) if getattr(config, "ple_embedding_dtype", None) else ("bf16", 2)
    saved = table.num_rows * table.cols * value_bytes / 2**20
    assert (f"ple: {names[0]} <- {table.name}.shard_{{0..2}}.weight ({table.num_rows} x 8 {fmt} "
            f"in model-ngram-1-0.safetensors, model-ngram-1-1.safetensors, "
            f"model-ngram-1-2.safetensors) served from the checkpoint's files: {saved:.2f} MiB of "
            "memory saved") in caplog.text
    assert vllm_config.additional_config["ple_tables"] == {
        name: module.table.handle for name, module in tables.served.items()}
    published = written["layout"] == "published"
    assert table.name.startswith("model.language_model.layers.1." if published else
                                 "model.layers.1.")
    assert tables.holds(f"{table.name}.shard_2.weight")
    assert tables.holds(f"{table.name}.weight_scale")
    assert not tables.holds(table.name.replace("ngram_embedding", "layer_multipliers"))
    assert not any(name.startswith("ple_embedding.") for name, _ in layers[1].named_parameters())

    tables, layers = build_layers(config, vllm_config, directory, written, names[1], monkeypatch)
    assert list(tables.served) == [names[1]]
    assert not isinstance(layers[1].ple_embedding, Qwen4ExpNGramEmbedding)
    assert isinstance(layers[2].ple_embedding, Qwen4ExpNGramEmbedding)

    tables, _ = build_layers(config, vllm_config, directory, written, "none", monkeypatch)
    assert tables.served == {}
    with pytest.raises(ValueError, match=r"PLE_OFFLOAD names \['model.self_decoder.embed_tokens_"
                                         r"per_layer'\], which this Qwen4Exp model has not"):
        build_layers(config, vllm_config, directory, written,
                     "model.self_decoder.embed_tokens_per_layer", monkeypatch)


def test_a_table_vllm_would_read_otherwise_is_refused(checkpoint, vllm_config, monkeypatch):
    """An FP8 table where vLLM's config reads unscaled rows (or a bf16 one
    where it reads FP8) would give other rows than vLLM's: refused."""
    directory, config, written = checkpoint
    other = text_config(not getattr(config, "ple_embedding_dtype", None))
    with pytest.raises(ValueError, match=r"but its table .* is (fp8_e4m3fn|bf16): ple serves"):
        build_layers(other, vllm_config, directory, written, "auto", monkeypatch)


def test_the_plugin_registers_both_qwen4exp_classes(monkeypatch):
    from vllm import ModelRegistry

    monkeypatch.setenv("PLE_OFFLOAD", "auto")
    before = {arch: ModelRegistry.models[arch] for arch in ARCHITECTURES}
    try:
        register()
        for arch in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"):
            entry = ModelRegistry.models[arch]
            assert (entry.module_name, entry.class_name) == (
                "ple.integrations.vllm.qwen4_exp_models", arch)
    finally:
        ModelRegistry.models.update(before)


def test_the_model_classes_import_where_vllms_do():
    """vLLM's Qwen4Exp classes import torchvision (through Qwen3-VL), which
    is missing here or, installed, fails to load beside the CPU torch
    (RuntimeError): ple's classes are checked where vLLM's import."""
    try:
        from vllm.models import qwen4_exp

        qwen4_exp.Qwen4ExpForCausalLM  # noqa: B018
    except (ModuleNotFoundError, RuntimeError) as error:
        pytest.skip(f"vLLM's Qwen4Exp classes do not import here: {error}")
    from ple.integrations.vllm import qwen4_exp_models

    for arch in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"):
        ours = getattr(qwen4_exp_models, arch)
        assert issubclass(ours, getattr(qwen4_exp, arch))
