"""ple inside vLLM (ple.integrations.vllm, docs/vllm.md): a tiny random Gemma
3n served through ``vllm.LLM`` on the CPU with its ``embed_tokens_per_layer``
in the checkpoint's files, against the same model with the table in memory
(every logprob to the bit), against transformers (the tokens), eager and
under vLLM's torch.compile, with the engine in-process and in its own
process; the table's bytes never read at load; a warm vLLM compile cache in
a second process whose tables open in another order.  The multimodal Gemma 3n
too, with text prompts and its vision tower stubbed (see
``without_vision_tower``).

vLLM runs in subprocesses with a timeout (one process runs several engines:
vLLM's start-up is most of the cost).  Needs vLLM (``make test-vllm``);
skipped without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (AutoModel, Gemma3nAudioFeatureExtractor, Gemma3nConfig,  # noqa: E402
                          Gemma3nForCausalLM, Gemma3nForConditionalGeneration, Gemma3nProcessor,
                          Gemma3nTextConfig, Gemma3nVisionConfig, PreTrainedTokenizerFast,
                          SiglipImageProcessorPil)
from transformers.models.gemma3n import modeling_gemma3n  # noqa: E402

from helpers import PAGE, REPO, resident_pages  # noqa: E402

# A session of several engines takes a few minutes on 2 idle cores, three
# times that on a busy machine; a hang still fails.
TIMEOUT_S = 900
TABLE = "model.embed_tokens_per_layer.weight"
# The published multimodal checkpoints' name of the table.
MULTIMODAL_TABLE = "model.language_model.embed_tokens_per_layer.weight"
OTHERS_FILE = "model-00001-of-00002.safetensors"
TABLE_FILE = "model-00002-of-00002.safetensors"
# A tiny Gemma 3n whose per-layer table is 1024 x 64 float32 (256 KiB, 64
# pages: a whole-file read shows); the logits are tied to embed_tokens, as
# vLLM's Gemma 3n needs.
GEMMA_CONFIG = dict(
    vocab_size=1024, vocab_size_per_layer_input=1024, hidden_size=64,
    hidden_size_per_layer_input=16, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_kv_shared_layers=2,
    laurel_rank=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
    activation_sparsity_pattern=[0.0] * 4, altup_num_inputs=2, max_position_embeddings=128,
    tie_word_embeddings=True)
# The multimodal Gemma 3n over the same text model, with towers as small as
# their configs allow (no vision tower is built: without_vision_tower).
MULTIMODAL_CONFIG = dict(
    text_config=GEMMA_CONFIG, vision_config=dict(hidden_size=32),
    audio_config=dict(hidden_size=32, input_feat_size=16, conf_num_attention_heads=2,
                      conf_num_hidden_layers=1, sscp_conv_channel_size=(8, 4)))
# The tokens of Gemma 3n's processor that vLLM's multimodal processor looks
# up (its multimodal tokens and the newlines it merges), the last ids of the
# tiny vocabulary.
PROCESSOR_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                    "image_token": "<image_soft_token>", "boa_token": "<start_of_audio>",
                    "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>"}
NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
# vLLM treats a multimodal model that may take no image nor audio as a text
# model, and vLLM 0.32's Gemma 3n multimodal forward then raises ("inputs_embeds
# is required on the first PP rank"): the engines may take an audio clip (and
# no image), which runs the text prompts through embed_input_ids.  No profile
# run of a dummy clip: vLLM pads its audio soft tokens with the vocabulary's
# last id as an audio token, which the published vocabulary ends with and the
# tiny one (whose ids are all text, as transformers reads them) has not.
MULTIMODAL_LLM = {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 0, "audio": 1},
                  "skip_mm_profiling": True}
PROMPTS = [[5, 17, 99, 3, 1000, 45, 700, 12], [7, 8, 9], [300, 301, 302, 303, 2]]
MAX_TOKENS = 6
LOGPROBS = 3

# One process, several engines in turn (vllm.LLM); argv: a JSON spec.  Each
# arm sets PLE_OFFLOAD before its engine is built (the plugin reads it then;
# with the engine in its own process, vLLM loads the plugin there afresh),
# and reports its tokens, its logprobs as float.hex (bits), its tables'
# counters and the table's resident pages after load; an arm with "refused"
# expects its engine to raise and reports the message.
SESSION = r"""
import gc, importlib, json, os, sys

def drop_pages(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)

def table_stats(model):
    from ple.layers import DiskEmbedding
    return {name: {"rows": module.table.stats()["rows"], "handle": module.table.handle}
            for name, module in model.named_modules() if isinstance(module, DiskEmbedding)}

def main():
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, spec["tests"])
    from helpers import resident_pages
    if spec["prepare"]:  # "module:function" of the tests, run before any engine
        module, function = spec["prepare"].split(":")
        getattr(importlib.import_module(module), function)()
    from vllm import LLM, SamplingParams
    from torch._dynamo.utils import counters
    import ple
    # A table of the same name from other files, opened before the model's.
    other = os.environ.get("TEST_OPEN_FIRST_TABLE")
    opened_first = ple.Table.from_safetensors(other, "model.embed_tokens_per_layer.weight") if other else None
    for arm in spec["arms"]:
        for name, value in arm.get("env", {}).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        model = arm.get("model", spec["model"])
        for name in arm.get("touch", []):
            os.utime(os.path.join(model, name), ns=(0, 10**18))
        if arm.get("drop_pages"):
            gc.collect()
            for name in spec["files"]:
                drop_pages(os.path.join(model, name))
        options = {"skip_tokenizer_init": True, "dtype": "float32", "seed": 0,
                   "max_model_len": 128, "max_num_seqs": 4, "gpu_memory_utilization": 0.1,
                   "enforce_eager": arm["eager"], **arm.get("llm", {})}
        try:
            llm = LLM(model=model, **options)
        except Exception as error:
            if not arm.get("refused"):
                raise
            print("RESULT " + json.dumps({"name": arm["name"], "refused": str(error)}), flush=True)
            continue
        table_file = os.path.join(model, spec["table_file"])
        resident = resident_pages(table_file) if os.path.exists(table_file) else None
        outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]],
                               SamplingParams(max_tokens=spec["max_tokens"], temperature=0,
                                              logprobs=spec["logprobs"], detokenize=False))
        result = {"name": arm["name"], "resident_table_pages": resident,
                  "inductor": dict(counters["inductor"]),
                  "tables": llm.apply_model(table_stats)[0],
                  "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                  "logprobs": [[{str(k): v.logprob.hex() for k, v in step.items()}
                                for step in o.outputs[0].logprobs] for o in outputs]}
        if spec["engine_in_process"]:  # the worker's config is the engine's
            config = llm.llm_engine.vllm_config
            result["additional_config"] = config.additional_config
            result["config_hash"] = config.compute_hash()
        print("RESULT " + json.dumps(result), flush=True)
        del llm, outputs
        gc.collect()
"""


def without_vision_tower(module):
    """A patch (a context manager, or ``.start()``) of ``module``'s AutoModel
    (transformers' or vLLM's Gemma 3n modeling module) that builds Gemma 3n's
    vision tower as an empty module: transformers builds it with timm, which
    imports torchvision, and no torchvision loads beside torch 2.13's CPU
    build (docs/vllm.md).  Text prompts never run it; vLLM, asked for no
    image, keeps it unloaded on the meta device."""

    class AutoModelWithoutVision:
        @staticmethod
        def from_config(config, **kwargs):
            if isinstance(config, Gemma3nVisionConfig):
                return torch.nn.Module()
            return AutoModel.from_config(config, **kwargs)

    return mock.patch.object(module, "AutoModel", AutoModelWithoutVision)


def build_gemma3n_without_vision_tower() -> None:
    """A session's preparation (run_session's ``prepare``): vLLM's
    multimodal Gemma 3n builds its vision tower empty (without_vision_tower)."""
    from vllm.model_executor.models import gemma3n_mm

    without_vision_tower(gemma3n_mm).start()


def write_checkpoint(directory: Path, seed: int = 0, **config) -> Path:
    """A tiny random Gemma 3n (see save_sharded); ``config``: fields of
    GEMMA_CONFIG changed."""
    torch.manual_seed(seed)
    model = Gemma3nForCausalLM(Gemma3nTextConfig(**{**GEMMA_CONFIG, **config})).eval()
    with_per_layer_inputs(model.model)
    return save_sharded(model, TABLE, directory)


def write_multimodal_checkpoint(directory: Path, **text_config) -> Path:
    """A tiny random multimodal Gemma 3n in the published layout (the table
    is MULTIMODAL_TABLE), without its vision tower's weights, and a processor
    for it (vLLM's multimodal processor needs a tokenizer): a word-level
    tokenizer of the ids, whose last ids are PROCESSOR_TOKENS and NEWLINES.
    ``text_config``: fields of GEMMA_CONFIG changed."""
    torch.manual_seed(0)
    config = {**MULTIMODAL_CONFIG, "text_config": {**GEMMA_CONFIG, **text_config}}
    with without_vision_tower(modeling_gemma3n):
        model = Gemma3nForConditionalGeneration(Gemma3nConfig(**config)).eval()
    with_per_layer_inputs(model.model.language_model)
    save_sharded(model, MULTIMODAL_TABLE, directory)
    tokens = [*PROCESSOR_TOKENS.values(), *NEWLINES]
    first = GEMMA_CONFIG["vocab_size"] - len(tokens)
    vocabulary = {**{f"t{i}": i for i in range(first)},
                  **{token: first + i for i, token in enumerate(tokens)}}
    words = Tokenizer(models.WordLevel(vocabulary, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.add_tokens([AddedToken(newline, normalized=False) for newline in NEWLINES])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0",
                                        extra_special_tokens=PROCESSOR_TOKENS)
    mel_bins = MULTIMODAL_CONFIG["audio_config"]["input_feat_size"]  # the audio tower's input
    Gemma3nProcessor(Gemma3nAudioFeatureExtractor(feature_size=mel_bins),
                     SiglipImageProcessorPil(size={"height": 32, "width": 32}),
                     tokenizer).save_pretrained(directory)
    return directory


def with_per_layer_inputs(text_model):
    """``text_model`` (Gemma 3n's) with its altup scales drawn at random:
    initialized to zero, they multiply the per-layer inputs' whole
    contribution, and the logits would not depend on the table."""
    for layer in text_model.layers:
        torch.nn.init.normal_(layer.altup.correct_output_scale)
    return text_model


def save_sharded(model, table_name: str, directory: Path) -> Path:
    """``model`` saved by transformers, re-saved as two files and an index,
    as the published checkpoints are sharded: the table ``table_name`` alone
    in TABLE_FILE (a small file shared with other tensors is read whole by
    the kernel's readahead around their pages), flushed to the disk (so that
    their pages can be dropped)."""
    model.save_pretrained(directory)
    single = directory / "model.safetensors"
    with safe_open(single, "pt") as f:
        weights = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    single.unlink()
    table = {table_name: weights.pop(table_name)}
    for name, part in ((OTHERS_FILE, weights), (TABLE_FILE, table)):
        save_file(part, str(directory / name), metadata={"format": "pt"})
        fd = os.open(directory / name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    weight_map = {**dict.fromkeys(weights, OTHERS_FILE), table_name: TABLE_FILE}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def run_session(model: Path, arms: list[dict], *, engine_in_process: bool,
                env: dict | None = None, cwd: Path | None = None,
                prepare: str | None = None, timeout_s: float = TIMEOUT_S) -> tuple[dict, str]:
    """Runs the arms in one new interpreter; ({arm name: result}, its log).
    ``prepare``: ``"module:function"`` of the tests that the interpreter
    calls before it builds any engine, to patch vLLM (the engines must be
    in-process), e.g. ``"test_vllm:build_gemma3n_without_vision_tower"``.
    The interpreter imports modules from the model's parent directory first
    (the session's module is written there)."""
    spec = {"model": str(model), "arms": arms, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "logprobs": LOGPROBS, "files": [OTHERS_FILE, TABLE_FILE], "table_file": TABLE_FILE,
            "tests": str(REPO / "tests"), "engine_in_process": engine_in_process,
            "prepare": prepare}
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if engine_in_process else "1",
                   # apply_model sends a function to the engine's process
                   "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **(env or {})}
    environment.pop("PLE_OFFLOAD", None)
    # An importable module, so that apply_model's function pickles by name
    # into the engine's process.
    session = model.parent / "vllm_session.py"
    session.write_text(SESSION)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(session.parent),
                                                              environment.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", "import vllm_session; vllm_session.main()",
                           json.dumps(spec)], capture_output=True,
                          text=True, timeout=timeout_s, env=environment, cwd=cwd or model)
    return session_results(done, arms)


def session_results(done: subprocess.CompletedProcess, arms: list[dict]) -> tuple[dict, str]:
    """A finished session's {arm name: result}, from its RESULT lines, and
    its log; fails the test when the session failed or left an arm out."""
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line.removeprefix("RESULT "))
            results[result["name"]] = result
    assert [arm["name"] for arm in arms] == list(results), log[-6000:]
    return results, log


def arm(name: str, offload: str | None, *, eager: bool, **extra) -> dict:
    return {"name": name, "env": {"PLE_OFFLOAD": offload}, "eager": eager, **extra}


def assert_same_outputs(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"], (a["name"], b["name"])
    assert a["logprobs"] == b["logprobs"], (a["name"], b["name"])


def max_logprob_difference(a: dict, b: dict) -> float:
    return max(abs(float.fromhex(x[token]) - float.fromhex(y[token]))
               for steps_a, steps_b in zip(a["logprobs"], b["logprobs"])
               for x, y in zip(steps_a, steps_b) for token in x.keys() & y.keys())


def transformers_tokens(model: Path, model_class=Gemma3nForCausalLM) -> list[list[int]]:
    """Greedy tokens of transformers' ``model_class`` over the checkpoint."""
    reference = model_class.from_pretrained(model, dtype=torch.float32).eval()
    tokens = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                     do_sample=False, min_new_tokens=MAX_TOKENS)
            tokens.append(out[0, len(prompt):].tolist())
    return tokens


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("gemma3n"))


@pytest.fixture(scope="module")
def in_process(gemma):
    """Engines in-process, one after another: vLLM's whole-file load strategy
    with the table in memory, then offloaded; then eager and compiled, the
    table in memory ("none") and offloaded ("auto")."""
    # The plugin is loaded once per process, at the first engine: "none" asks
    # for ple's classes, every later arm's PLE_OFFLOAD is read as its model
    # is built.
    eager_load = {"safetensors_load_strategy": "eager"}
    # The first compiled engine of a process gives some logprobs that differ
    # in the last bit from those of every later one, the in-memory model's
    # too (vLLM's and inductor's state, not ple's): compiled arms are
    # compared after it.
    arms = [arm("eager-load-in-memory", "none", eager=True, drop_pages=True, llm=eager_load),
            arm("eager-load-ple", "auto", eager=True, drop_pages=True, llm=eager_load),
            arm("eager-in-memory", "none", eager=True),
            arm("compiled-first", "none", eager=False),
            arm("compiled-in-memory", "none", eager=False),
            arm("compiled-ple", "auto", eager=False)]
    return run_session(gemma, arms, engine_in_process=True, env=compile_caches(gemma.parent))


def compile_caches(directory: Path) -> dict[str, str]:
    """vLLM's and inductor's caches in ``directory``."""
    return {"VLLM_CACHE_ROOT": str(directory / "vllm-cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(directory / "inductor-cache")}


def assert_offloaded_equals_in_memory(results: dict, log: str, module: str, tensor: str) -> None:
    """The offloaded arms ("eager-load-ple", "compiled-ple") give the
    outputs of the in-memory ones, the rows of ``module`` gathered by ple
    from the table ``tensor``, which the log line names."""
    assert_same_outputs(results["eager-load-ple"], results["eager-in-memory"])
    assert_same_outputs(results["compiled-ple"], results["compiled-in-memory"])
    assert results["compiled-ple"]["tokens"] == results["eager-load-ple"]["tokens"]
    for name in ("eager-load-ple", "compiled-ple"):
        (table,) = results[name]["tables"].values()
        assert table["rows"] > 0  # the rows came through ple
        assert list(results[name]["tables"]) == [module]
    assert results["eager-in-memory"]["tables"] == {}
    assert f"ple: {module} <- {tensor} (1024 x 64 f32 in {TABLE_FILE}) served from the " \
           "checkpoint's files: 0.25 MiB of memory saved" in log


def test_offloaded_gemma_equals_the_in_memory_model_eager_and_compiled(in_process):
    results, log = in_process
    assert_offloaded_equals_in_memory(results, log, "model.self_decoder.embed_tokens_per_layer",
                                      TABLE)
    assert "ple's computes them from embed_tokens_per_layer as transformers does" in log


def test_offloaded_gemma_gives_transformers_tokens(gemma, in_process):
    results, _ = in_process
    assert results["compiled-ple"]["tokens"] == transformers_tokens(gemma)


def test_the_table_is_never_read_at_load_even_with_a_whole_file_strategy(gemma, in_process):
    results, log = in_process
    pages = -(-(gemma / TABLE_FILE).stat().st_size // PAGE)
    # vLLM's eager strategy reads the whole file, the table with it ...
    assert results["eager-load-in-memory"]["resident_table_pages"] == pages
    # ... but not with ple: the header's read (with the few pages of the
    # kernel's readahead: 4 here) and row 0, which the profile run gathers.
    assert results["eager-load-ple"]["resident_table_pages"] <= 8 < pages
    assert "ple: safetensors_load_strategy='eager' reads whole files, the tables' too: " \
           "loading with 'lazy' instead" in log


def test_engine_in_its_own_process(gemma, in_process):
    """The engine in a process of its own (the plugin loaded there), as
    vLLM serves by default: compiled and offloaded, from the compile caches
    the in-process session filled (compiling again takes minutes on a busy
    machine).  It is the first compiled engine of its process: the tokens
    of the in-process offloaded engine, logprobs within their last bits
    (see in_process)."""
    inherited, _ = in_process
    results, log = run_session(gemma, [arm("compiled-ple", "auto", eager=False)],
                               engine_in_process=False, env=compile_caches(gemma.parent))
    own, in_process_ple = results["compiled-ple"], inherited["compiled-ple"]
    assert own["tokens"] == in_process_ple["tokens"]
    assert max_logprob_difference(own, in_process_ple) < 1e-5
    assert own["tables"].keys() == in_process_ple["tables"].keys()
    (table,) = own["tables"].values()
    assert table["rows"] > 0
    assert "served from the checkpoint's files" in log


def test_unasked_the_plugin_changes_nothing(gemma, in_process):
    """With PLE_OFFLOAD unset vLLM's own class serves: no table of ple, no
    log line, and (vLLM 0.32's text-only class computing no per-layer
    inputs) a zeroed table gives the same logprobs, unlike ple's class."""
    mended, _ = in_process
    zeroed = gemma.parent / "gemma3n-zeroed-table"
    zeroed.mkdir()
    for file in gemma.glob("*.json"):  # the configs and the index
        (zeroed / file.name).write_text(file.read_text())
    (zeroed / OTHERS_FILE).write_bytes((gemma / OTHERS_FILE).read_bytes())
    with safe_open(gemma / TABLE_FILE, "pt") as f:
        table = f.get_tensor(TABLE)
    save_file({TABLE: torch.zeros_like(table)}, str(zeroed / TABLE_FILE), metadata={"format": "pt"})
    arms = [arm("vllm-own", None, eager=True),
            arm("vllm-own-zeroed", None, eager=True, model=str(zeroed))]
    results, log = run_session(gemma, arms, engine_in_process=True)
    assert results["vllm-own"]["tables"] == {}
    assert_same_outputs(results["vllm-own"], results["vllm-own-zeroed"])
    assert results["vllm-own"]["logprobs"] != mended["eager-in-memory"]["logprobs"]
    assert "ple:" not in log


def test_a_warm_compile_cache_in_a_process_whose_tables_open_in_another_order(tmp_path):
    """A second process opens another checkpoint's table of the same name
    first, then serves the model over the first process's compile cache:
    the cached graph gathers from the model's own table.

    On the CPU vLLM 0.32 compiles with torch.compile's inductor backend
    (CompilationMode.DYNAMO_TRACE_ONCE), so the warm cache is inductor's FX
    graph cache, which keys on the traced graph and so on the table's handle
    in it.  vLLM's AOT cache (its default with torch >= 2.12; on CUDA its own
    backend's cache too) keys on vllm_config's hash and loads the graph with
    the handle it was traced with: ple adds the tables' handles to
    additional_config, which that hash covers, so a table whose files
    changed (a new mtime here, in the test's last engine) gets a new key, and vLLM compiles anew rather
    than load a graph that would find no table.  That AOT cache fails to
    load on the CPU ("'function' object has no attribute
    'finalize_loading'", the table in memory too), so its load is not run
    here; the key is checked."""
    other = write_checkpoint(tmp_path / "other", seed=1)
    model = write_checkpoint(tmp_path / "model")
    caches = compile_caches(tmp_path)
    compiled = arm("compiled-ple", "auto", eager=False)
    first = run_session(model, [compiled], engine_in_process=True, env=caches)[0]["compiled-ple"]
    # The same table's file with another mtime: the table has another handle.
    touched = {**compiled, "name": "touched", "touch": [TABLE_FILE]}
    opens_another_first = {"TEST_OPEN_FIRST_TABLE": str(other / TABLE_FILE)}
    results, _ = run_session(model, [compiled, touched], engine_in_process=True,
                             env={**caches, **opens_another_first})
    second, third = results["compiled-ple"], results["touched"]
    assert first["inductor"].get("fxgraph_cache_hit", 0) == 0 < first["inductor"]["fxgraph_cache_miss"]
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0 < second["inductor"]["fxgraph_cache_hit"]
    assert_same_outputs(first, second)
    assert second["tables"] == first["tables"]  # the same handle: the same files' table
    (handle,) = [table["handle"] for table in first["tables"].values()]
    assert first["additional_config"] == {
        "ple_tables": {"model.self_decoder.embed_tokens_per_layer": handle}}
    assert second["config_hash"] == first["config_hash"]
    assert third["tables"] != first["tables"] and third["config_hash"] != first["config_hash"]
    # The second compiled engine of its process: the same tokens, logprobs
    # within the last bits of the first engine's (see in_process).
    assert third["tokens"] == first["tokens"]
    assert max_logprob_difference(first, third) < 1e-5


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory) -> tuple[Path, dict, str]:
    """The multimodal Gemma 3n's engines in-process, text prompts: eager,
    the table in memory, then offloaded with vLLM's whole-file load strategy
    (the table's pages dropped first); compiled (after a first compiled
    engine, see in_process), in memory and offloaded."""
    directory = tmp_path_factory.mktemp("gemma3n-multimodal")
    model = write_multimodal_checkpoint(directory / "model")
    eager_load = {**MULTIMODAL_LLM, "safetensors_load_strategy": "eager"}
    arms = [arm("eager-in-memory", "none", eager=True, llm=MULTIMODAL_LLM),
            arm("eager-load-ple", "auto", eager=True, drop_pages=True, llm=eager_load),
            arm("compiled-first", "none", eager=False, llm=MULTIMODAL_LLM),
            arm("compiled-in-memory", "none", eager=False, llm=MULTIMODAL_LLM),
            arm("compiled-ple", "auto", eager=False, llm=MULTIMODAL_LLM)]
    results, log = run_session(model, arms, engine_in_process=True, env=compile_caches(directory),
                               prepare="test_vllm:build_gemma3n_without_vision_tower")
    return model, results, log


def test_offloaded_multimodal_gemma_equals_the_in_memory_model_eager_and_compiled(multimodal):
    """The multimodal class computes the per-layer inputs itself, in
    embed_input_ids (eagerly, outside the compiled graph), through ple's
    table."""
    _, results, log = multimodal
    assert_offloaded_equals_in_memory(results, log,
                                      "language_model.model.self_decoder.embed_tokens_per_layer",
                                      MULTIMODAL_TABLE)
    assert "ple's computes them" not in log  # said of the text-only class only


def test_offloaded_multimodal_gemma_gives_transformers_tokens(multimodal):
    model, results, _ = multimodal
    with without_vision_tower(modeling_gemma3n):
        expected = transformers_tokens(model, Gemma3nForConditionalGeneration)
    assert results["compiled-ple"]["tokens"] == expected


def test_the_multimodal_table_is_never_read_at_load(multimodal):
    """Offloaded with vLLM's eager (whole-file) strategy: the header's read
    and the kernel's readahead around it, not the table's 64 pages."""
    model, results, log = multimodal
    pages = -(-(model / TABLE_FILE).stat().st_size // PAGE)
    assert results["eager-load-ple"]["resident_table_pages"] <= 8 < pages
    assert "loading with 'lazy' instead" in log
