"""Gemma 4 E2B/E4B in vLLM (ple.integrations.vllm.gemma4, docs/vllm.md): a
tiny random Gemma 4 of E4B's structure served through ``vllm.LLM`` on the
CPU with its per-layer table ``embed_tokens_per_layer`` in the checkpoint's
files, against the same model with the table in memory (every logprob to
the bit) and against transformers (the greedy tokens), eager and under
vLLM's torch.compile:

- a text checkpoint (transformers' ``Gemma4ForCausalLM``) through the
  text-only class; the table's bytes never read at load; a row changed on
  disk changes the tokens of the prompt that reads it, and only those; a
  Gemma 4 without per-layer inputs serves nothing; a module Gemma 4 lacks is
  refused;
- the published multimodal layout (transformers'
  ``Gemma4ForConditionalGeneration``, the table as
  ``model.language_model.embed_tokens_per_layer.weight``) through the
  text-only class (``hf_overrides``), the multimodal class with text
  prompts, and the multimodal class as a language model only;
- a chunked prefill read ahead (``PLE_LOOKAHEAD_MIB``);
- the same on CUDA, with CUDA graphs (skipped without a GPU: not run here).

vLLM runs in subprocesses, several engines in each (tests/test_vllm.py's
sessions).  The multimodal class needs two stand-ins here, where no
torchvision loads beside torch 2.13's CPU build: ``tests/without_torchvision``
(transformers' Gemma 4 processor's module imports torchvision) and
:func:`build_processor_for_text_prompts` (vLLM's multimodal processor).
Needs vLLM (``make test-vllm``); skipped without it."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
pytest.importorskip("transformers.models.gemma4", reason="transformers has no Gemma 4")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (Gemma4AudioConfig, Gemma4Config, Gemma4ForCausalLM,  # noqa: E402
                          Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig,
                          PreTrainedTokenizerFast)

from helpers import PAGE, REPO  # noqa: E402
from test_vllm import (MULTIMODAL_TABLE, PROMPTS, TABLE, TABLE_FILE, arm,  # noqa: E402
                       assert_offloaded_equals_in_memory, assert_same_outputs, compile_caches,
                       run_session, save_sharded, transformers_tokens)
from test_vllm_lookahead import LONG, MAX_TOKENS, run_arms  # noqa: E402

pytestmark = pytest.mark.slow  # each session runs several vLLM engines (minutes)

needs_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# E4B's structure at a tiny size: the per-layer inputs of all layers packed
# in one table (1024 x (4 layers x 16) float32: 256 KiB, as Gemma 3n's in
# test_vllm.py), the last two layers sharing the KV of earlier ones, sliding
# and full attention (the full layers with heads of their own size), a final
# logit soft cap, the lm_head tied to embed_tokens.
TEXT_CONFIG = dict(
    vocab_size=1024, vocab_size_per_layer_input=1024, hidden_size=64,
    hidden_size_per_layer_input=16, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
    num_kv_shared_layers=2, sliding_window=16,
    layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=256,
    final_logit_softcapping=30.0, tie_word_embeddings=True)
# The multimodal model's special tokens (as Gemma 4's tokenizer spells them)
# and their ids, the last of the tiny vocabulary: the prompts are text.
SPECIAL_TOKENS = {"image_token": ("<|image|>", 1016), "video_token": ("<|video|>", 1017),
                  "audio_token": ("<|audio|>", 1018), "boi_token": ("<|image>", 1019),
                  "eoi_token": ("<image|>", 1020), "boa_token": ("<|audio>", 1021),
                  "eoa_token": ("<audio|>", 1022)}
PLACEHOLDERS = dict(image_token_id=1016, video_token_id=1017, audio_token_id=1018,
                    boi_token_id=1019, eoi_token_id=1020, boa_token_id=1021, eoa_token_index=1022)
MODULE = "model.embed_tokens_per_layer"  # as the text-only class names it
MULTIMODAL_MODULE = f"language_model.{MODULE}"
WITHOUT_TORCHVISION = {"PYTHONPATH": str(REPO / "tests" / "without_torchvision")}
PREPARE = "test_vllm_gemma4:build_processor_for_text_prompts"
# vLLM's options for each way of serving the published layout: the text-only
# class (vLLM's Gemma4ForCausalLM maps the language model's tensors); the
# multimodal class with text prompts (it may take an audio clip, so that
# vLLM runs it as a multimodal model: the per-layer inputs are gathered in
# its embed_input_ids, eagerly); the multimodal class as a language model
# only (vLLM runs its text model on the token ids, which gathers them in
# the compiled forward).  No profile run of dummy multimodal data.
AS_TEXT = {"hf_overrides": {"architectures": ["Gemma4ForCausalLM"]}}
MULTIMODAL = {"skip_tokenizer_init": False, "skip_mm_profiling": True,
              "limit_mm_per_prompt": {"image": 0, "video": 0, "audio": 1}}
LANGUAGE_MODEL_ONLY = {"language_model_only": True}
EAGER_LOAD = {"safetensors_load_strategy": "eager"}  # vLLM's whole-file strategy
# The token whose per-layer row the changed checkpoint changes: in the first
# prompt only.
CHANGED_TOKEN = 99
SESSION_TIMEOUT_S = 900


def multimodal_config(**text_config) -> Gemma4Config:
    """The multimodal Gemma 4 over TEXT_CONFIG (``text_config``: its fields
    changed), with a vision and an audio tower as small as their configs
    allow; ``default_output_length`` (soft tokens per image), which the
    published configs hold and vLLM reads, one of the sizes vLLM supports."""
    return Gemma4Config(
        text_config=Gemma4TextConfig(**{**TEXT_CONFIG, **text_config}),
        vision_config=Gemma4VisionConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, head_dim=16,
                                         position_embedding_size=64, default_output_length=70),
        audio_config=Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2),
        **PLACEHOLDERS)


def write_text_checkpoint(directory: Path, **text_config) -> Path:
    """A tiny random text Gemma 4, saved by transformers' Gemma4ForCausalLM
    and sharded with its table alone in a file (test_vllm.save_sharded);
    ``text_config``: fields of TEXT_CONFIG changed."""
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**TEXT_CONFIG, **text_config})).eval()
    return save_sharded(model, TABLE, directory)


def write_multimodal_checkpoint(directory: Path, **text_config) -> Path:
    """A tiny random multimodal Gemma 4 in the published layout, sharded
    with its table alone in a file, and a tokenizer for vLLM's multimodal
    processor: a word-level tokenizer of the ids with SPECIAL_TOKENS.
    ``text_config``: fields of TEXT_CONFIG changed."""
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(multimodal_config(**text_config)).eval()
    save_sharded(model, MULTIMODAL_TABLE, directory)
    vocabulary = {f"t{i}": i for i in range(TEXT_CONFIG["vocab_size"])}
    vocabulary.update(dict(SPECIAL_TOKENS.values()))
    words = Tokenizer(models.WordLevel(vocabulary, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {key: token for key, (token, _) in SPECIAL_TOKENS.items()}
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0",
                            extra_special_tokens=special).save_pretrained(directory)
    return directory


def write_without_per_layer_inputs(directory: Path) -> Path:
    """A text Gemma 4 whose config has no per-layer inputs (as Gemma 4's
    larger models): no table, one file."""
    torch.manual_seed(0)
    Gemma4ForCausalLM(Gemma4TextConfig(**{**TEXT_CONFIG, "hidden_size_per_layer_input": 0})
                      ).eval().save_pretrained(directory)
    return directory


def write_changed_row(model: Path, directory: Path) -> Path:
    """A copy of the checkpoint ``model`` but for the per-layer table's row
    CHANGED_TOKEN, far from the rows drawn at random (an initializer's
    scale)."""
    shutil.copytree(model, directory)
    with safe_open(model / TABLE_FILE, "pt") as f:
        table = f.get_tensor(TABLE)
    table[CHANGED_TOKEN] = torch.linspace(-1, 1, table.shape[1])
    save_file({TABLE: table}, str(directory / TABLE_FILE), metadata={"format": "pt"})
    return directory


def build_processor_for_text_prompts() -> None:
    """A session's preparation (run_session's ``prepare``): vLLM's
    multimodal Gemma 4 builds transformers' Gemma 4 processor from the
    checkpoint's tokenizer, a feature extractor of the audio tower's
    defaults, the PIL image processor and no video processor (transformers'
    needs torchvision; the engines take no video), instead of loading it
    from the checkpoint's files (which hold the tokenizer alone)."""
    from transformers import (AutoTokenizer, Gemma4AudioFeatureExtractor, Gemma4ImageProcessorPil,
                              Gemma4Processor)
    from vllm.model_executor.models import gemma4_mm

    class WithoutVideos(Gemma4Processor):
        def check_argument_for_proper_class(self, name, argument):
            if name == "video_processor":
                return None
            return super().check_argument_for_proper_class(name, argument)

    @functools.cache
    def processor(model: str):
        return WithoutVideos(Gemma4AudioFeatureExtractor(), Gemma4ImageProcessorPil(),
                             AutoTokenizer.from_pretrained(model), None)

    gemma4_mm.Gemma4ProcessingInfo.get_hf_processor = \
        lambda info, **kwargs: processor(info.ctx.model_config.model)


def equality_arms(prefix: str, llm: dict, *, compiled: bool = True) -> tuple[list, list]:
    """The arms that compare the offloaded model with the in-memory one,
    served with vLLM's options ``llm``: eager, the table in memory, then
    offloaded with vLLM's whole-file load strategy after the table's pages
    are dropped; compiled, in memory and offloaded.  (eager arms, compiled
    arms), named ``prefix`` and test_vllm's names."""
    eager = [arm(f"{prefix}eager-in-memory", "none", eager=True, llm=llm),
             arm(f"{prefix}eager-load-ple", "auto", eager=True, drop_pages=True,
                 llm={**llm, **EAGER_LOAD})]
    return eager, ([arm(f"{prefix}compiled-in-memory", "none", eager=False, llm=llm),
                    arm(f"{prefix}compiled-ple", "auto", eager=False, llm=llm)] if compiled else [])


def arms_of(results: dict, prefix: str) -> dict:
    """The results of the arms named ``prefix``..., by the rest of their names."""
    return {name.removeprefix(prefix): result for name, result in results.items()
            if name.startswith(prefix)}


def assert_never_read_at_load(result: dict, model: Path) -> None:
    """Offloaded with vLLM's whole-file strategy, the table's pages dropped
    before: resident after load, the header's read and the kernel's
    readahead around it (and row 0, which the profile run gathers), not the
    table's 64 pages."""
    pages = -(-(model / TABLE_FILE).stat().st_size // PAGE)
    assert result["resident_table_pages"] <= 8 < pages


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> Path:
    return write_text_checkpoint(tmp_path_factory.mktemp("gemma4-text") / "model")


@pytest.fixture(scope="module")
def text(text_model) -> tuple[dict, str]:
    """The text checkpoint's engines, in-process: the whole-file load
    strategy with the table in memory (its pages dropped first), then the
    equality arms; the changed checkpoint, in memory and offloaded; a
    Gemma 4 without per-layer inputs, offloaded; compiled arms after a first
    compiled engine (test_vllm.in_process says why); last, a module Gemma 4
    lacks, refused."""
    directory = text_model.parent
    changed = write_changed_row(text_model, directory / "changed")
    no_table = write_without_per_layer_inputs(directory / "no-per-layer-inputs")
    eager, compiled = equality_arms("", {})
    arms = [arm("eager-load-in-memory", "none", eager=True, drop_pages=True, llm=EAGER_LOAD),
            *eager,
            arm("changed-in-memory", "none", eager=True, model=str(changed)),
            arm("changed-ple", "auto", eager=True, model=str(changed)),
            arm("no-per-layer-inputs", "auto", eager=True, model=str(no_table)),
            arm("compiled-first", "none", eager=False), *compiled,
            arm("unknown-module", "model.embed_tokens", eager=True, refused=True)]
    return run_session(text_model, arms, engine_in_process=True, env=compile_caches(directory),
                       timeout_s=SESSION_TIMEOUT_S)


def test_offloaded_text_gemma4_equals_the_in_memory_model_eager_and_compiled(text):
    results, log = text
    assert_offloaded_equals_in_memory(results, log, MODULE, TABLE)


def test_offloaded_text_gemma4_gives_transformers_tokens(text_model, text):
    results, _ = text
    expected = transformers_tokens(text_model, Gemma4ForCausalLM)
    assert results["eager-load-ple"]["tokens"] == results["compiled-ple"]["tokens"] == expected


def test_the_table_is_never_read_at_load_even_with_a_whole_file_strategy(text_model, text):
    results, log = text
    pages = -(-(text_model / TABLE_FILE).stat().st_size // PAGE)
    # vLLM's eager strategy reads the whole file, the table with it ...
    assert results["eager-load-in-memory"]["resident_table_pages"] == pages
    # ... but not with ple.
    assert_never_read_at_load(results["eager-load-ple"], text_model)
    assert "ple: safetensors_load_strategy='eager' reads whole files, the tables' too: " \
           "loading with 'lazy' instead" in log


def test_a_row_changed_on_disk_changes_the_prompt_that_reads_it(text):
    """The checkpoint with row CHANGED_TOKEN changed: the prompt holding
    that token gives other tokens, the others (which never read that row)
    the same tokens and logprobs, offloaded as in memory: the rows come
    from the files."""
    results, _ = text
    changed, original = results["changed-ple"], results["eager-in-memory"]
    assert_same_outputs(changed, results["changed-in-memory"])
    assert [CHANGED_TOKEN in prompt for prompt in PROMPTS] == [True, False, False]
    assert changed["tokens"][0] != original["tokens"][0]
    assert changed["tokens"][1:] == original["tokens"][1:]
    assert changed["logprobs"][1:] == original["logprobs"][1:]
    assert all(CHANGED_TOKEN not in tokens for tokens in original["tokens"] + changed["tokens"])
    (table,) = changed["tables"].values()
    assert table["rows"] > 0


def test_a_gemma4_without_per_layer_inputs_serves_nothing(text):
    results, log = text
    assert results["no-per-layer-inputs"]["tables"] == {}
    assert len(results["no-per-layer-inputs"]["tokens"]) == len(PROMPTS)
    assert "ple: this Gemma 4 has no per-layer inputs (hidden_size_per_layer_input is 0): no " \
           "table to serve" in log


def test_a_module_gemma4_lacks_is_refused(text):
    results, _ = text
    assert results["unknown-module"]["refused"] == (
        "ple: PLE_OFFLOAD names ['model.embed_tokens'], which Gemma 4 has not as an embedding ple "
        "can serve: it serves 'model.embed_tokens_per_layer' "
        "('language_model.model.embed_tokens_per_layer' in the multimodal class; its other "
        "embedding, embed_tokens, is tied to the logits)")


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, dict, str]:
    """The published layout's engines, in-process: served by the text-only
    class ("text-"), the multimodal class with text prompts ("multimodal-")
    and the multimodal class as a language model only ("language-model-",
    eager only), the equality arms of each, the compiled ones after a first
    compiled engine."""
    directory = tmp_path_factory.mktemp("gemma4-published")
    model = write_multimodal_checkpoint(directory / "model")
    as_text, multimodal, language_model = (equality_arms("text-", AS_TEXT),
                                           equality_arms("multimodal-", MULTIMODAL),
                                           equality_arms("language-model-", LANGUAGE_MODEL_ONLY,
                                                         compiled=False))
    arms = [*as_text[0], *multimodal[0], *language_model[0],
            arm("compiled-first", "none", eager=False, llm=AS_TEXT), *as_text[1], *multimodal[1]]
    results, log = run_session(model, arms, engine_in_process=True, prepare=PREPARE,
                               env={**compile_caches(directory), **WITHOUT_TORCHVISION},
                               timeout_s=SESSION_TIMEOUT_S)
    return model, results, log


def test_the_published_layout_through_the_text_only_class(published):
    model, results, log = published
    assert_offloaded_equals_in_memory(arms_of(results, "text-"), log, MODULE, MULTIMODAL_TABLE)
    assert_never_read_at_load(results["text-eager-load-ple"], model)


def test_the_multimodal_class_with_text_prompts(published):
    """The per-layer inputs gathered in embed_input_ids (eagerly, outside
    the compiled graph), through ple's table."""
    model, results, log = published
    assert_offloaded_equals_in_memory(arms_of(results, "multimodal-"), log, MULTIMODAL_MODULE,
                                      MULTIMODAL_TABLE)
    assert_never_read_at_load(results["multimodal-eager-load-ple"], model)


def test_the_multimodal_class_as_a_language_model_only(published):
    _, results, _ = published
    language_model = arms_of(results, "language-model-")
    assert_same_outputs(language_model["eager-load-ple"], language_model["eager-in-memory"])
    assert list(language_model["eager-load-ple"]["tables"]) == [MULTIMODAL_MODULE]


def test_the_published_layout_gives_transformers_tokens(published):
    """Every way of serving it gives transformers' greedy tokens."""
    model, results, _ = published
    expected = transformers_tokens(model, Gemma4ForConditionalGeneration)
    for name in ("text-compiled-ple", "multimodal-compiled-ple", "language-model-eager-load-ple"):
        assert results[name]["tokens"] == expected, name


@pytest.fixture(scope="module")
def lookahead(text_model) -> dict:
    """The text checkpoint's chunked prefill (test_vllm_lookahead's
    session: 16-token chunks, a 100-token prompt alone, then beside a
    90-token one), lookahead off and on."""
    return run_arms(text_model, [{"name": "off", "env": {"PLE_LOOKAHEAD_MIB": "0"}},
                                 {"name": "on", "env": {"PLE_LOOKAHEAD_MIB": "64"}}],
                    text_model.parent)


def assert_lookahead_serves_the_chunks(arms: dict) -> None:
    """The same bits on and off; the lone prompt's chunks 2 to 7 served by
    prefetches (its first chunk's gather finds them pending: a miss)."""
    for batch in ("alone", "together"):
        assert_same_outputs({"name": "on", **arms["on"][batch]},
                            {"name": "off", **arms["off"][batch]})
    on, off = arms["on"]["alone"]["stats"], arms["off"]["alone"]["stats"]
    assert (on["prefetch_hits"], on["prefetch_misses"]) == (6, 1)
    assert (off["prefetch_hits"], off["prefetch_misses"]) == (0, 0)


def test_a_chunked_prefill_is_read_ahead(lookahead):
    """Also: the lone prompt's rows gathered once, then its decode steps';
    the two prompts together as test_vllm_lookahead describes."""
    assert_lookahead_serves_the_chunks(lookahead)
    on, off = lookahead["on"]["alone"]["stats"], lookahead["off"]["alone"]["stats"]
    assert on["rows"] == off["rows"] == len(LONG) + MAX_TOKENS - 1
    together = lookahead["on"]["together"]["stats"]
    assert (together["prefetch_hits"], together["prefetch_misses"]) == (5 + 2, 2)


@needs_a_gpu
def test_on_cuda_offloaded_equals_in_memory_with_cuda_graphs(text_model, tmp_path):
    """On CUDA (vLLM's CUDA build): the text checkpoint and the published
    layout's multimodal class, eager and with CUDA graphs, FULL (the text
    model's gather captured in the graph; the multimodal class gathers in
    embed_input_ids, outside it) and PIECEWISE."""
    graphs = {mode: {"compilation_config": {"cudagraph_mode": mode}}
              for mode in ("FULL", "PIECEWISE")}
    arms = [*equality_arms("", {}, compiled=False)[0],
            arm("compiled-first", "none", eager=False)]
    for mode, llm in graphs.items():
        arms += equality_arms(f"{mode}-", llm)[1]
    results, log = run_session(text_model, arms, engine_in_process=True,
                               env=compile_caches(tmp_path), timeout_s=SESSION_TIMEOUT_S)
    eager = {name: results[name] for name in ("eager-in-memory", "eager-load-ple")}
    for mode in graphs:
        assert_offloaded_equals_in_memory({**eager, **arms_of(results, f"{mode}-")}, log, MODULE,
                                          TABLE)
    assert results["FULL-compiled-ple"]["tokens"] == transformers_tokens(text_model,
                                                                         Gemma4ForCausalLM)
    model = write_multimodal_checkpoint(tmp_path / "published" / "model")
    eager, _ = equality_arms("", MULTIMODAL)
    graphed = equality_arms("", {**MULTIMODAL, **graphs["FULL"]})[1]
    results, log = run_session(model, [*eager, arm("compiled-first", "none", eager=False,
                                                   llm=MULTIMODAL), *graphed],
                               engine_in_process=True, prepare=PREPARE,
                               env={**compile_caches(tmp_path / "published"),
                                    **WITHOUT_TORCHVISION}, timeout_s=SESSION_TIMEOUT_S)
    assert_offloaded_equals_in_memory(results, log, MULTIMODAL_MODULE, MULTIMODAL_TABLE)


@needs_a_gpu
def test_on_cuda_a_chunked_prefill_is_read_ahead_with_cuda_graphs(text_model, tmp_path):
    """On CUDA with CUDA graphs: each 16-token chunk runs in a captured
    graph, whose forward gathers the chunk's ids padded to the graph's size,
    which begin with the chunk's: its prefetch serves it.  The arms compared
    come after a first compiled engine (test_vllm.in_process says why)."""
    arms = run_arms(text_model, [
        {"name": "compiled-first", "env": {"PLE_LOOKAHEAD_MIB": "0"}},
        {"name": "off", "env": {"PLE_LOOKAHEAD_MIB": "0"}},
        {"name": "on", "env": {"PLE_LOOKAHEAD_MIB": "64"}}], tmp_path, enforce_eager=False)
    assert_lookahead_serves_the_chunks(arms)
