"""ple.integrations.transformers against transformers' own loading of the same
checkpoint: tiny random Qwen4Exp and Gemma 3n models built from configs,
saved with save_pretrained, loaded both ways; logits and greedy generation
equal to the bit (fp32 and bf16, eager and compiled), offload() on built
models, named modules, the errors, the tables' counters, .to(), CUDA
(skipped without a GPU), the peak memory of loading a 1 GiB table, and two
gloo ranks of transformers' own tensor parallelism with the tables split by
rows across them (this file runs as a script once per rank)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")

from transformers import (Gemma3nForCausalLM, Gemma3nTextConfig, Qwen4ExpForCausalLM,  # noqa: E402
                          Qwen4ExpTextConfig)

import ple  # noqa: E402
from helpers import quiet_transformers  # noqa: E402, F401 (an autouse fixture)
from helpers import REPO, assert_same_bits, load_module, run_ranks  # noqa: E402
from ple.integrations.families import auto_module_names as auto_names  # noqa: E402
from ple.integrations.transformers import (ScaledDiskEmbedding, from_pretrained,  # noqa: E402
                                           offload, tables)
from ple.layers import DiskEmbedding  # noqa: E402
from ple.layers.parallel import row_range  # noqa: E402
from ple.table import _open_tables  # noqa: E402
from ple_tools.bench_transformers import MODEL_CONFIG  # noqa: E402

# The benchmark's tiny Qwen4Exp, smaller still: 32-wide n-gram rows.
QWEN_CONFIG = {**MODEL_CONFIG, "vocab_size": 256, "hidden_size": 64, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
               "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
               "hc_lowrank": 8, "ple_embed_dim": 32, "ngram_vocab_size_base": 1000,
               "split_ngram_parts": 4}
GEMMA_CONFIG = dict(
    vocab_size=256, vocab_size_per_layer_input=128, hidden_size=64, hidden_size_per_layer_input=8,
    intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, num_kv_shared_layers=2, laurel_rank=8, sliding_window=16,
    layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
    altup_num_inputs=2, max_position_embeddings=128, tie_word_embeddings=False)
QWEN_TABLES = [f"model.layers.{i}.ple.ple_embedding.ngram_embedding" for i in (0, 1)]
GEMMA_TABLES = ["model.embed_tokens_per_layer"]
MODELS = {"qwen4exp": (Qwen4ExpForCausalLM, Qwen4ExpTextConfig, QWEN_CONFIG, QWEN_TABLES),
          "gemma3n": (Gemma3nForCausalLM, Gemma3nTextConfig, GEMMA_CONFIG, GEMMA_TABLES)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{model: directory}: each tiny model saved with save_pretrained (Qwen4Exp
    in several files, so that its shard families span them)."""
    directories = {}
    for key, (model_class, config_class, fields, names) in MODELS.items():
        torch.manual_seed(0)
        model = model_class(config_class(**fields)).eval()
        if key == "gemma3n":
            # Initialized to zero, this scale multiplies the per-layer inputs'
            # whole contribution: the logits would not depend on the table.
            for layer in model.model.layers:
                torch.nn.init.normal_(layer.altup.correct_output_scale)
        assert_logits_depend_on(model, names)
        directory = tmp_path_factory.mktemp(key)
        model.save_pretrained(directory, **({"max_shard_size": "64KB"} if key == "qwen4exp" else {}))
        directories[key] = directory
    assert len(list(directories["qwen4exp"].glob("*.safetensors"))) > 2
    return directories


def assert_logits_depend_on(model, names) -> None:
    """Changing any one of the tables changes the logits (else comparing
    logits would not test the tables)."""
    ids = prompt()
    with torch.no_grad():
        logits = model(ids).logits
        for name in names:
            weight = model.get_submodule(name).weight
            saved = weight.clone()
            weight.mul_(1.5).add_(0.01)
            assert not torch.equal(model(ids).logits, logits), f"the logits ignore {name}"
            weight.copy_(saved)


def prompt(seed: int = 0, shape=(2, 7)) -> torch.Tensor:
    ids = torch.randint(3, 256, shape, generator=torch.Generator().manual_seed(seed))
    ids[0, shape[1] // 2] = 1  # an EOS inside: Qwen4Exp's n-grams restart after it
    return ids


def load_both(checkpoints, key, offload="auto", **kwargs):
    """transformers' model and ple's, from the same directory."""
    model_class = MODELS[key][0]
    reference = model_class.from_pretrained(checkpoints[key], **kwargs)
    served, info = from_pretrained(model_class, checkpoints[key], offload=offload,
                                   output_loading_info=True, **kwargs)
    return reference, served, info


def shard_index(key: str) -> int:
    """A state dict key's shard number (0 for a tensor of its own)."""
    part = key.rsplit(".", 2)[-2]
    return int(part.removeprefix("shard_")) if part.startswith("shard_") else 0


@pytest.mark.parametrize("key", MODELS)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["checkpoint-dtype", "bfloat16"])
def test_logits_and_generation_equal_transformers(checkpoints, key, dtype, caplog):
    model_class, _, _, names = MODELS[key]
    kwargs = {} if dtype is None else {"dtype": dtype}
    with caplog.at_level(logging.INFO, logger="ple.integrations.transformers"):
        reference, served, info = load_both(checkpoints, key, **kwargs)
    assert type(served) is model_class
    assert served.config.architectures == [model_class.__name__]
    # Nothing unexpected or missing: the tables' tensors were skipped quietly.
    assert info["unexpected_keys"] == set() and info["missing_keys"] == set()
    assert sorted(served.ple_offloaded) == names
    assert sorted(tables(served)) == names
    # The state dict holds each table as the checkpoint holds it (a shard family by its shards).
    reference_state, served_state = reference.state_dict(), served.state_dict()
    table_keys = {k for k in served_state for n in names if k.startswith(f"{n}.")}
    assert set(reference_state) - set(served_state) == (
        {f"{n}.weight" for n in names} if key == "qwen4exp" else set())
    for n in names:
        shards = [served_state[k] for k in sorted(table_keys, key=shard_index) if k.startswith(n)]
        assert torch.equal(torch.cat(shards).to(reference_state[f"{n}.weight"].dtype),
                           reference_state[f"{n}.weight"])
    assert f"ple: {len(names)} table" in caplog.text
    assert (f"{names[0]} <- {names[0]}.shard_{{0..3}}.weight" if key == "qwen4exp"
            else f"{names[0]} <- {names[0]}.weight") in caplog.text
    for name in names:
        module = served.get_submodule(name)
        assert isinstance(module, DiskEmbedding)
        assert module.dtype == reference.get_submodule(name).weight.dtype == (dtype or torch.float32)
    before = {name: t.stats()["rows"] for name, t in tables(served).items()}
    ids = prompt()
    with torch.no_grad():
        assert_same_bits(served(ids).logits, reference(ids).logits)
        after = {name: t.stats()["rows"] for name, t in tables(served).items()}
        assert all(after[name] > before[name] for name in names)
        want = reference.generate(ids, max_new_tokens=4, do_sample=False)
        got = served.generate(ids, max_new_tokens=4, do_sample=False)
    assert want.shape == (2, 11)
    assert torch.equal(got, want)


def test_gemma_scale_is_initialized_after_loading(checkpoints):
    """transformers' loader empties every non-persistent buffer and refills
    only its own modules': the scale must be the original's value."""
    reference, served, _ = load_both(checkpoints, "gemma3n", dtype=torch.bfloat16)
    module = served.model.embed_tokens_per_layer
    assert isinstance(module, ScaledDiskEmbedding)
    original = reference.model.embed_tokens_per_layer
    assert module.embed_scale.dtype == original.embed_scale.dtype == torch.bfloat16
    assert torch.equal(module.embed_scale, original.embed_scale)
    assert module.scalar_embed_scale == original.scalar_embed_scale


def compiled_equals_eager_reference(key, checkpoints, ids, fullgraph):
    """torch.compile of the served model (aot_eager: dynamo, fake tensors and
    functionalization, with eager kernels, so equal to eager to the bit)."""
    reference, served, _ = load_both(checkpoints, key)
    compiled = torch.compile(served, backend="aot_eager", fullgraph=fullgraph)
    with torch.no_grad():
        assert_same_bits(compiled(ids).logits, reference(ids).logits)
    torch._dynamo.reset()


def test_compiled_gemma_equals_transformers(checkpoints):
    """Gemma 3n in one graph: the ple op adds no graph break."""
    compiled_equals_eager_reference("gemma3n", checkpoints, prompt(1, (2, 5)), fullgraph=True)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PLE_COMPILE_QWEN4EXP") != "1",
                    reason="PLE_COMPILE_QWEN4EXP=1 runs it (30 to 60 s on 2 cores)")
def test_compiled_qwen4exp_equals_transformers(checkpoints):
    """The whole Qwen4Exp model, with its own graph breaks (its QSA indexer
    loops over tokens, its MoE routes by nonzero): 30 to 60 s on 2 cores even
    for 3 tokens, so only on request.  What ple changes in it, the PLE
    layers, compiles in one graph in test_compiled_qwen4exp_ple_layers."""
    compiled_equals_eager_reference("qwen4exp", checkpoints, prompt(1, (1, 3)), fullgraph=False)


def test_compiled_qwen4exp_ple_layers_equal_transformers(checkpoints):
    """Each PLE layer of Qwen4Exp (transformers' n-gram ids, ple's gather
    through the module's own ``ngram_embedding(ids.to(weight.device))``, the
    projections and the convolution) in one graph."""
    reference, served, _ = load_both(checkpoints, "qwen4exp")
    ids = prompt(2)
    hidden = torch.randn(*ids.shape, QWEN_CONFIG["hc_count"] * QWEN_CONFIG["hidden_size"],
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i in (0, 1):
            compiled = torch.compile(served.model.layers[i].ple, backend="aot_eager",
                                     fullgraph=True)
            assert_same_bits(compiled(hidden, ids, None),
                             reference.model.layers[i].ple(hidden, ids, None))
    torch._dynamo.reset()


def test_to_casts_and_moves_the_served_modules(checkpoints):
    reference, served, _ = load_both(checkpoints, "gemma3n")
    ids = prompt(2)
    for model in (reference, served):
        assert model.to(torch.bfloat16) is model
        model.to("cpu")
    module = served.model.embed_tokens_per_layer
    assert module.dtype == module.embed_scale.dtype == torch.bfloat16
    with torch.no_grad():
        assert_same_bits(served(ids).logits, reference(ids).logits)


def test_named_modules_are_offloaded(checkpoints):
    """An explicit list: Qwen4Exp's token embedding (a plain nn.Embedding)
    alone, then with the n-gram tables; Gemma 3n's scaled token embedding
    and its per-layer table."""
    cases = [("qwen4exp", ["model.embed_tokens"]),
             ("qwen4exp", ["model.embed_tokens", *QWEN_TABLES]),
             ("gemma3n", ["model.embed_tokens", "model.embed_tokens_per_layer"])]
    for key, names in cases:
        reference, served, info = load_both(checkpoints, key, offload=names)
        assert info["unexpected_keys"] == set() and info["missing_keys"] == set()
        assert sorted(tables(served)) == sorted(names)
        if key == "qwen4exp" and len(names) == 1:  # the n-gram tables stay in memory
            assert isinstance(served.get_submodule(QWEN_TABLES[0]), torch.nn.Embedding)
        if key == "gemma3n":
            assert isinstance(served.model.embed_tokens, ScaledDiskEmbedding)
            assert served.get_input_embeddings() is served.model.embed_tokens
        ids = prompt(3)
        with torch.no_grad():
            assert_same_bits(served(ids).logits, reference(ids).logits)
            assert torch.equal(served.generate(ids, max_new_tokens=3, do_sample=False),
                               reference.generate(ids, max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("key", MODELS)
def test_offload_a_model_built_on_the_meta_device(checkpoints, key):
    model_class, config_class, fields, names = MODELS[key]
    with torch.device("meta"):
        model = model_class(config_class(**fields))
    assert auto_names(model) == names
    opened = offload(model, checkpoints[key])
    assert sorted(opened) == names == sorted(model.ple_offloaded)
    reference = model_class.from_pretrained(checkpoints[key])
    for name in names:
        module = model.get_submodule(name)
        assert module.table is opened[name] and module.dtype_tracker.device.type == "cpu"
        weight = reference.get_submodule(name).weight.detach()
        ids = torch.randint(0, weight.shape[0], (3, 4))
        want = torch.nn.functional.embedding(ids, weight)
        if isinstance(module, ScaledDiskEmbedding):
            scale = reference.get_submodule(name).embed_scale
            assert torch.equal(module.embed_scale, scale)
            want = want * scale.to(weight.dtype)
        assert_same_bits(module(ids), want)
    # Nothing left for "auto" to do: a warning, and no table opened.
    assert offload(model, checkpoints[key]) == {}


def test_offload_a_loaded_model_keeps_its_outputs(checkpoints):
    for key in MODELS:
        model_class = MODELS[key][0]
        reference = model_class.from_pretrained(checkpoints[key])
        model = model_class.from_pretrained(checkpoints[key])
        opened = offload(model, checkpoints[key], ["model.embed_tokens", *auto_names(model)])
        assert len(opened) == len(MODELS[key][3]) + 1
        ids = prompt(4)
        with torch.no_grad():
            assert_same_bits(model(ids).logits, reference(ids).logits)


def test_errors_are_clear(checkpoints, tmp_path):
    qwen, gemma = checkpoints["qwen4exp"], checkpoints["gemma3n"]
    with pytest.raises(TypeError, match=r"'model.layers.0.mlp' is a Qwen4ExpTextSparseMoeBlock, "
                                        "not an nn.Embedding"):
        from_pretrained(Qwen4ExpForCausalLM, qwen, offload=["model.layers.0.mlp"])
    with pytest.raises(ValueError, match="has no module named 'model.nope'"):
        from_pretrained(Qwen4ExpForCausalLM, qwen, offload=["model.nope"])
    with pytest.raises(FileNotFoundError, match="not a local checkpoint directory"):
        from_pretrained(Qwen4ExpForCausalLM, tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_pretrained(Qwen4ExpForCausalLM, tmp_path)
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**QWEN_CONFIG))
    # The tables of another model's checkpoint: not found, and what was looked for.
    with pytest.raises(ValueError, match=r"no table for 'model.layers.0.ple.ple_embedding."
                                         r"ngram_embedding' in .*looked for a tensor "
                                         r"'model.layers.0.ple.ple_embedding.ngram_embedding."
                                         r"weight' or a shard family"):
        offload(model, gemma)
    # Tables of another size: the first, opened, is closed again, and the
    # model is left as it was.
    before = set(_open_tables)  # other tests' tables may be collected meanwhile
    with torch.device("meta"):
        other = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**{**QWEN_CONFIG,
                                                          "ngram_vocab_size_base": 1100}))
    with pytest.raises(ValueError, match=r"is an embedding of \d+ x 8, but its table "
                                         r"'model.layers.0.ple.ple_embedding.ngram_embedding' "
                                         r"in .* has 4096 rows of 8"):
        offload(other, qwen, ["model.embed_tokens", *QWEN_TABLES])
    assert set(_open_tables) <= before
    assert type(other.model.embed_tokens) is torch.nn.Embedding
    # A tied embedding: its other side needs the table in memory.
    with torch.device("meta"):
        tied = Gemma3nForCausalLM(Gemma3nTextConfig(**{**GEMMA_CONFIG, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' is tied to 'lm_head.weight'"):
        offload(tied, gemma, ["model.embed_tokens"])
    offload(model, qwen, QWEN_TABLES)
    with pytest.raises(ValueError, match="already served by ple"):
        offload(model, qwen, QWEN_TABLES[:1])


# ---- CUDA (skipped without a GPU) -------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("key", MODELS)
def test_cuda_model_gathers_on_the_gpu(checkpoints, key):
    """model.to("cuda"): the ids reach disk_gather on CUDA (its CUDA kernel),
    and the logits are those of transformers' model on the GPU."""
    reference, served, _ = load_both(checkpoints, key, dtype=torch.bfloat16)
    reference.to("cuda")
    served.to("cuda")
    calls = []
    for name in MODELS[key][3]:
        module = served.get_submodule(name)
        assert module.dtype_tracker.is_cuda and module.weight.device.type == "meta"
        module.register_forward_pre_hook(lambda m, args: calls.append(args[0].device.type))
    before = {name: t.stats()["rows"] for name, t in tables(served).items()}
    ids = prompt(5).cuda()
    with torch.no_grad():
        want = reference(ids).logits
        got = served(ids).logits
        assert got.is_cuda and calls and set(calls) == {"cuda"}
        assert all(t.stats()["rows"] > before[name] for name, t in tables(served).items())
        assert_same_bits(got, want)
        assert torch.equal(served.generate(ids, max_new_tokens=3, do_sample=False),
                           reference.generate(ids, max_new_tokens=3, do_sample=False))


# ---- tensor parallelism ------------------------------------------------------------

# transformers' tensor parallelism splits the k/v heads across the ranks: the
# tiny Gemma's one k/v head does not split in two.
TP_FIELDS = {"qwen4exp": {}, "gemma3n": {"num_key_value_heads": 2}}
TP_TIMEOUT_S = 300


def test_offloaded_modules_leave_the_tp_plan(checkpoints):
    """Qwen4Exp's plan splits the n-gram tables by columns ("embedding_colwise"),
    whose hooks would hand ple's gather DTensors; ple takes the rule out."""
    rule = "model.layers.*.ple.ple_embedding.ngram_embedding"
    reference, served, _ = load_both(checkpoints, "qwen4exp")
    assert reference.tp_plan[rule] == "embedding_colwise"
    assert rule not in served.tp_plan
    assert {k: v for k, v in reference.tp_plan.items() if k != rule} == served.tp_plan


@pytest.mark.parametrize("key", MODELS)
def test_tensor_parallel_ranks_with_split_tables_equal_transformers(key, tmp_path):
    """Two gloo ranks load the model with transformers' tensor parallelism
    (tp_size=2), once as transformers does and once with ple's tables split
    by rows across the ranks (process_group=): the same logits on every rank,
    bit for bit."""
    pytest.importorskip("accelerate", reason="transformers' tensor parallelism needs accelerate")
    model_class, config_class, fields, names = MODELS[key]
    torch.manual_seed(0)
    model_class(config_class(**{**fields, **TP_FIELDS[key]})).save_pretrained(tmp_path / "model")
    # CPU ranks: where a GPU is visible, transformers' tensor parallelism puts
    # the model on it while these gloo ranks keep their inputs on the CPU.
    run_ranks(Path(__file__), [key, str(tmp_path)], 2, TP_TIMEOUT_S, tmp_path / "logs",
              {**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert_same_bits(got["served"], got["transformers"])
        assert got["served_rows"] == {name: row_range(num_rows, rank, 2)
                                      for name, num_rows in got["num_rows"].items()}
        assert set(got["served_rows"]) == set(names)


def tensor_parallel_rank(key: str, directory: Path, rank: int, world_size: int) -> None:
    """One rank of the test above: logits of transformers' tensor-parallel
    model and of ple's, with the tables split across the default group."""
    import torch.distributed as dist
    from transformers import DistributedConfig

    transformers.logging.set_verbosity_error()
    # transformers uses the default group that exists (else it would start
    # one from torchrun's variables).
    dist.init_process_group("gloo", init_method=f"file://{directory / 'store'}", rank=rank,
                            world_size=world_size)
    try:
        model_class = MODELS[key][0]
        parallel = DistributedConfig(tp_size=world_size)
        reference = model_class.from_pretrained(directory / "model", distributed_config=parallel)
        served = from_pretrained(model_class, directory / "model", distributed_config=parallel,
                                 process_group=dist.group.WORLD)
        with torch.no_grad():
            saved = {"transformers": reference(prompt()).logits, "served": served(prompt()).logits}
        modules = {name: served.get_submodule(name) for name in served.ple_offloaded}
        saved["served_rows"] = {name: module.served_rows for name, module in modules.items()}
        saved["num_rows"] = {name: module.num_embeddings for name, module in modules.items()}
        torch.save(saved, directory / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# ---- memory -----------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, sys, torch, transformers
    from transformers import Qwen4ExpForCausalLM
    transformers.logging.set_verbosity_error()

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

    mode, directory, out = sys.argv[1:]
    before = status("VmRSS")
    if mode == "ple":
        from ple.integrations.transformers import from_pretrained
        model = from_pretrained(Qwen4ExpForCausalLM, directory)
    else:
        model = Qwen4ExpForCausalLM.from_pretrained(directory)
    loaded = status("VmHWM") - before
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.save(model(ids).logits, out)
    print(json.dumps({"loaded": loaded, "peak": status("VmHWM") - before}))
""")


@pytest.mark.slow
def test_loading_a_1gib_table_stays_out_of_memory(tmp_path):
    """A Qwen4Exp checkpoint with one n-gram table of 1.07 GiB (8 shards,
    written one at a time): ple's load peaks far below the table's size,
    transformers' holds it all; the logits are equal."""
    bench = load_module("bench_transformers_for_test", REPO / "tools" / "bench_transformers.py")
    info = bench.write_checkpoint(tmp_path / "big", 2**30 + 2**26, ple_layers=1, shards=8,
                                  dtype=torch.float32)
    size = info["table_bytes"]
    assert size >= 2**30
    peaks = {}
    for mode in ("ple", "transformers"):
        run = subprocess.run([sys.executable, "-c", CHILD, mode, str(tmp_path / "big"),
                              str(tmp_path / f"{mode}.pt")],
                             capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        peaks[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"table {size / 2**20:.0f} MiB; peak RSS over the start: " + ", ".join(
        f"{mode} {p['loaded'] / 2**20:.0f} MiB loading, {p['peak'] / 2**20:.0f} MiB after a forward"
        for mode, p in peaks.items()))
    assert peaks["ple"]["peak"] < size / 8, peaks
    assert peaks["transformers"]["loaded"] > size * 0.95, peaks
    assert_same_bits(torch.load(tmp_path / "ple.pt"), torch.load(tmp_path / "transformers.pt"))


def test_bench_tool_arms_generate_the_same_tokens(tmp_path):
    """tools/bench_transformers.py's ple and in-memory arms, run in this
    process (the tool runs each in a child of its own) on a small
    checkpoint, which ensure_checkpoint then reuses."""
    bench = load_module("bench_transformers_for_arms", REPO / "tools" / "bench_transformers.py")
    directory = tmp_path / "ckpt"
    info = bench.ensure_checkpoint(directory, 0.005 * 2**30, torch.bfloat16)
    assert info["table_bytes"] > 0.004 * 2**30 and len(info["tables"]) == 2
    spec = {"dir": str(directory), "dtype": "bf16", "prompt": 4, "new_tokens": 2, "seed": 0}
    results = {arm: bench.run_arm({**spec, "arm": arm}) for arm in ("ple", "in-memory")}
    assert results["ple"]["tokens"] == results["in-memory"]["tokens"]
    assert len(results["ple"]["tokens"]) == 3 and results["ple"]["gathered_rows"] > 0
    assert all(len(r["token_ms"]) == 2 and len(r["token_ms"][0]) == 2 for r in results.values())
    mtime = (directory / bench.INFO).stat().st_mtime_ns
    assert bench.ensure_checkpoint(directory, 0.005 * 2**30, torch.bfloat16) == info
    assert (directory / bench.INFO).stat().st_mtime_ns == mtime


if __name__ == "__main__":
    tensor_parallel_rank(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
