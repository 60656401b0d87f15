"""tools/bench_prefill.py (ple-bench-prefill): on a small table, every arm
(the window, direct I/O with a row cache, lookahead over either) runs in a
child of its own and gives the same rows, which equal an independent NumPy
reading of the shards; lookahead takes every chunk from its prefetch; the table has the layout asked
for; an arm past its deadline is reported as timed out, not waited for; the
JSON document holds the arms, the token source and the goal check; real
text is tokenized with GPT-2's BPE; each arm warms up on a table of its
own; a thread profile names ple's threads and splits their CPU by phase of
the chunks."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ple_tools import bench_prefill
from ple_tools.make_table import PREFIX, SCALE
from ple_tools.table_layout import Layout

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "bench_prefill.py"
TOKENS = 3000  # two chunks of 2,048, the last one partial
# The others are configs alike.
ARMS = ["window", "direct-cache:16", "lookahead", "lookahead-direct-cache:16"]


def run_tool(*args, timeout=240):
    return subprocess.run([sys.executable, str(TOOL), "--quick", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    """Token ids in GPT-2's range without the tokenizer: the bytes of this
    Python's documentation (the tokenizer has a test of its own)."""
    path = tmp_path_factory.mktemp("prefill") / "tokens.npy"
    text = bench_prefill.python_docs(4 * TOKENS).encode()
    np.save(path, np.frombuffer(text, dtype=np.uint8)[:TOKENS].astype(np.int64) * 97)
    return path


@pytest.fixture(scope="module")
def quick(tokens_file):
    table, out = tokens_file.parent / "table", tokens_file.parent / "prefill.json"
    proc = run_tool("--table", table, "--tokens", tokens_file, "--tokens-count", TOKENS,
                    "--shards", 6, "--files", 4, "--arms", ",".join(ARMS), "--compute-ms", 20,
                    "--device", "cpu", "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())["results"], table


def test_every_arm_reports_its_figures_and_the_same_rows(quick):
    proc, doc, _ = quick
    arms = {r["arm"]: r for r in doc["arms"]}
    assert list(arms) == ARMS and doc["failed_arms"] == [] and doc["timed_out_arms"] == []
    assert doc["sha256_equal"] and len({r["sha256"] for r in arms.values()}) == 1
    assert doc["chunks"] == 2 and doc["row_reads"] == TOKENS * 16
    for arm, r in arms.items():
        assert len(r["per_chunk_s"]) == 2, arm
        assert r["seconds"] >= r["forward_s"] + r["compute_s"] > 0, arm
        assert r["compute_s"] >= 2 * 0.020, arm  # the busy compute ran after each chunk
        assert r["pages"] > 0 and r["read_bytes"] > 0, arm  # cold: read from disk
    assert arms["direct-cache:16"]["row_cache_hits"] > 0 and arms["window"]["row_cache_hits"] == 0
    assert arms["lookahead-direct-cache:16"]["row_cache_hits"] > 0
    # Both chunks came from their prefetches, read while the chunk before computed.
    assert arms["lookahead"]["prefetch_hits"] == arms["lookahead-direct-cache:16"]["prefetch_hits"] == 2
    assert arms["window"]["prefetch_hits"] == arms["direct-cache:16"]["prefetch_hits"] == 0
    assert arms["lookahead-direct-cache:16"]["direct_reads"] > 0
    check = doc["goal_checks"]["lookahead"]
    assert check["reads_alone_s"] == arms["window"]["forward_s"]
    assert check["lookahead_s"] == arms["lookahead"]["seconds"]
    cached = doc["goal_checks"]["lookahead-direct-cache:16"]
    assert cached["reads_alone_s"] == arms["direct-cache:16"]["forward_s"]
    assert cached["no_lookahead_s"] == arms["direct-cache:16"]["seconds"]
    assert cached["lookahead_over_window_lookahead"] == (
        arms["lookahead-direct-cache:16"]["seconds"] / arms["lookahead"]["seconds"])
    assert cached["read_bytes_over_window_lookahead"] == (
        arms["lookahead-direct-cache:16"]["read_bytes"] / arms["lookahead"]["read_bytes"])
    assert "lookahead: compute alone" in proc.stdout and "lookahead / no lookahead" in proc.stdout
    assert "lookahead-direct-cache:16: compute alone" in proc.stdout
    assert "lookahead / lookahead over the window" in proc.stdout
    assert doc["source"]["tokens"] == TOKENS and "tokens_sha256" in doc["source"]


def test_rows_equal_a_numpy_reading_of_the_shards(quick, tokens_file):
    """The SHA-256 of the layer's rows equals that of rows read from the
    files with np.memmap at the layout's offsets and scaled as the
    reference model does (bf16 values times the bf16 scale)."""
    _, doc, table = quick
    layout = Layout.open(table, PREFIX)
    assert len(layout.paths) == 4 and len(layout.shard_rows) == 6
    hashing = bench_prefill.hashing_of(bench_prefill.QUICK["ngram_base"])
    assert layout.num_rows == hashing.padded_rows(128)
    ids = hashing.row_ids(torch.from_numpy(np.load(tokens_file)[:TOKENS])).numpy().ravel()
    _, files, offsets = layout.locate(ids)
    maps = [np.memmap(p, dtype=np.uint8, mode="r") for p in layout.paths]
    raw = np.stack([maps[f][o:o + 160] for f, o in zip(files, offsets)])
    values = torch.from_numpy(raw).view(torch.float8_e4m3fn).to(torch.bfloat16)
    rows = (values * torch.tensor(SCALE).to(torch.bfloat16)).reshape(TOKENS, 16 * 160)
    assert hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest() == \
        doc["arms"][0]["sha256"]


def test_an_arm_past_its_deadline_is_reported_as_timed_out(quick, tokens_file):
    _, _, table = quick
    proc = run_tool("--table", table, "--tokens", tokens_file, "--tokens-count", TOKENS,
                    "--shards", 6, "--files", 4, "--arms", "window", "--device", "cpu",
                    "--deadline", 0.5, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "window" in proc.stdout and "TIMED OUT after 0 s" in proc.stdout
    assert "timed out (killed at 0 s): window" in proc.stdout


def test_a_timed_out_arm_reports_its_chunks_and_what_it_had_read():
    reads = {"read_bytes": 3 * 2**20, "pages": 9, "major_faults": 1, "row_cache_hits": 0,
             "prefetch_hits": 2, "direct_reads": 0, "io_backend": "mmap"}
    chunks = [{"chunk": 0, "forward_s": 1.5, "compute_s": 0.25,
               "reads": {**reads, "prefetch_hits": 1}},
              {"chunk": 1, "forward_s": 1.0, "compute_s": 0.25, "reads": reads}]
    record = bench_prefill.timed_out_record("lookahead", 5.0, chunks)
    assert record["per_chunk_s"] == [1.75, 1.25] and record["seconds_done"] == 3.0
    assert record["reads_done"] == reads
    assert bench_prefill.arm_line(record, 4) == (
        f"{'lookahead':<18} TIMED OUT after 5 s (2 of 4 chunks, 3.0 s; by then 3.0 MiB read, "
        "2 prefetch hits)")
    nothing = bench_prefill.timed_out_record("compute", 5.0, [])
    assert bench_prefill.arm_line(nothing, 4) == (
        f"{'compute':<18} TIMED OUT after 5 s (0 of 4 chunks, 0.0 s)")


def test_the_partial_goal_check_compares_the_chunks_every_arm_finished():
    def arm(name, per_chunk, **more):
        return {"arm": name, "per_chunk_s": per_chunk, **more}

    results = [arm("reads", [0.25, 0.25, 0.25], sha256="r"),
               arm("compute", [1.0, 1.5], timed_out=True),
               arm("lookahead", [1.0, 1.75, 2.0], timed_out=True),
               arm("window", [1.5, 1.5, 1.5, 1.5], sha256="w")]
    assert bench_prefill.goal_check(results, True) is None
    check = bench_prefill.partial_goal_check(results)
    # The bound: reads of 0.25 s, then 1.0 s of compute, then 1.5 s.
    assert check == {"chunks": 2, "compute_alone_s": 2.5, "reads_alone_s": 0.5,
                     "no_lookahead_s": 3.0, "lookahead_s": 2.75,
                     "lookahead_over_no_lookahead": 2.75 / 3.0, "lookahead_over_max": 2.75 / 2.5,
                     "overlap_bound_s": 2.75, "bound_over_no_lookahead": 2.75 / 3.0,
                     "lookahead_over_bound": 1.0}
    assert bench_prefill.partial_goal_check(results[1:]) is None  # no reads arm
    assert bench_prefill.partial_goal_check([arm("reads", []), *results[1:]]) is None
    # Without the window arm: no "no lookahead" to compare with.
    assert bench_prefill.partial_goal_check(results[:3])["no_lookahead_s"] is None


def test_the_goal_check_through_a_model_names_the_least_any_overlap_takes():
    # Reads 2, 2, 1 s back to back; chunk 1 computes 1 s from 2 s on, chunk 2
    # (its reads done at 4 s) from 4 to 5 s, chunk 3 from 5 to 8 s.
    assert bench_prefill.overlap_bound([1.0, 1.0, 3.0], [2.0, 2.0, 1.0]) == 8.0
    results = [{"arm": "compute", "seconds": 5.0, "per_chunk_s": [1.0, 1.0, 3.0], "sha256": "c"},
               {"arm": "reads", "forward_s": 5.0, "per_chunk_s": [2.0, 2.0, 1.0], "sha256": "r"},
               {"arm": "window", "seconds": 10.0, "sha256": "w"},
               {"arm": "lookahead", "seconds": 8.8, "sha256": "w"}]
    check = bench_prefill.goal_check(results, True)
    assert check["overlap_bound_s"] == 8.0 and check["bound_over_no_lookahead"] == 0.8
    assert check["lookahead_over_bound"] == pytest.approx(1.1)
    assert bench_prefill.goal_line(check).endswith(
        "; no overlap of these chunks takes less than 8.00 s (0.80x no lookahead), lookahead took "
        "1.10x of that")


def test_arms_name_a_way_of_running_and_a_reader():
    split = bench_prefill.split_arm
    assert split("lookahead") == ("lookahead", "window") and split("reads") == ("reads", "window")
    assert split("lookahead-direct-cache:512") == ("lookahead", "direct-cache:512")
    assert split("reads-direct") == ("reads", "direct") and split("all") == ("", "all")
    assert split("compute") == ("compute", None)
    for arm in ("lookahead", "reads-direct-cache:8", "direct-cache:8", "window"):
        assert bench_prefill.arm_name(*split(arm)) == arm
    assert bench_prefill.cache_mib("lookahead-direct-cache:512") == 512
    assert bench_prefill.cache_mib("reads-direct-cache:64") == 64
    assert bench_prefill.cache_mib("lookahead") == 0
    assert bench_prefill.arm_config("lookahead-direct-cache:8").row_cache_mib == 8
    assert bench_prefill.arm_config("reads-direct").io == "direct"
    with pytest.raises(KeyError):
        bench_prefill.arm_config("lookahead-nothing")


def test_the_goal_check_of_another_reader_compares_it_with_the_window():
    results = [{"arm": "compute", "seconds": 10.0, "per_chunk_s": [5.0, 5.0], "sha256": "c"},
               {"arm": "reads-direct-cache:512", "forward_s": 4.0, "per_chunk_s": [2.0, 2.0],
                "sha256": "r"},
               {"arm": "lookahead", "seconds": 12.0, "read_bytes": 4000, "sha256": "w"},
               {"arm": "lookahead-direct-cache:512", "seconds": 10.5, "read_bytes": 500,
                "sha256": "w"}]
    check = bench_prefill.goal_check(results, True, "direct-cache:512")
    assert check["reads_alone_s"] == 4.0 and check["no_lookahead_s"] is None
    assert check["lookahead_over_max"] == 1.05 and check["overlap_bound_s"] == 12.0
    assert check["lookahead_over_window_lookahead"] == 10.5 / 12.0
    assert check["read_bytes_over_window_lookahead"] == 0.125
    assert bench_prefill.goal_line(check, "direct-cache:512") == (
        "lookahead-direct-cache:512: compute alone 10.00 s, reads alone 4.00 s, lookahead "
        "10.50 s, lookahead / max(compute, reads) 1.05x (goal <= 1.05), lookahead / lookahead "
        "over the window 0.88x (goal <= 0.75), bytes read / lookahead over the window's 0.12x "
        "(goal <= 0.25); no overlap of these chunks takes less than 12.00 s, lookahead took "
        "0.88x of that")
    assert bench_prefill.goal_check(results, True) is None  # no reads arm over the window


def test_through_a_model_lookahead_gives_the_same_first_token(quick, tokens_file):
    pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")
    _, _, table = quick
    out = tokens_file.parent / "model.json"
    proc = run_tool("--table", table, "--tokens", tokens_file, "--tokens-count", 600,
                    "--chunk", 256, "--shards", 6, "--files", 4, "--model-layers", 3,
                    "--model-hidden", 64, "--model-experts", 2, "--device", "cpu",
                    "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())["results"]
    arms = {r["arm"]: r for r in doc["arms"]}
    assert list(arms) == ["compute", "reads", "reads-direct-cache:16", "window", "lookahead",
                          "lookahead-direct-cache:16"] and doc["sha256_equal"]
    assert arms["window"]["sha256"] == arms["lookahead"]["sha256"] == \
        arms["lookahead-direct-cache:16"]["sha256"]
    assert arms["reads"]["sha256"] == arms["reads-direct-cache:16"]["sha256"]
    assert arms["window"]["output"] == "first token" and arms["reads"]["output"] == "rows"
    # The compute arm reads none of the table: no page of its files came into
    # the page cache (whatever else the process read again under memory
    # pressure, its libraries say).
    assert arms["compute"]["pages"] is None and arms["compute"]["table_cached_bytes"] == 0
    assert arms["window"]["pages"] > 0 and arms["window"]["prefetch_hits"] == 0
    # Every chunk's rows were read ahead, through either reader.
    assert arms["lookahead"]["prefetch_hits"] == arms["lookahead-direct-cache:16"]["prefetch_hits"] == 3
    assert arms["lookahead-direct-cache:16"]["direct_reads"] > 0
    assert len(arms["window"]["per_chunk_s"]) == 3
    check = doc["goal_checks"]["lookahead"]
    assert check["compute_alone_s"] == arms["compute"]["seconds"]
    assert check["reads_alone_s"] == arms["reads"]["forward_s"]
    assert check["no_lookahead_s"] == arms["window"]["seconds"]
    cached = doc["goal_checks"]["lookahead-direct-cache:16"]
    assert cached["reads_alone_s"] == arms["reads-direct-cache:16"]["forward_s"]
    assert cached["lookahead_s"] == arms["lookahead-direct-cache:16"]["seconds"]


def test_real_text_is_tokenized_with_gpt2s_bpe(tmp_path):
    pytest.importorskip("tiktoken")
    args = bench_prefill.parse_args(["--quick", "--tokens-count", "2000",
                                     "--save-tokens", str(tmp_path / "t.npy")])
    try:
        tokens, source = bench_prefill.prompt_tokens(args)
    except (subprocess.SubprocessError, OSError) as error:
        pytest.skip(f"GPT-2's ranks could not be downloaded here: {error}")
    assert len(tokens) == 2000 and source["tokens"] == 2000
    assert source["ranks_sha256"] == bench_prefill.RANKS_SHA256
    assert source["text"].startswith("Python ") and source["text_chars"] > 5 * 2000
    assert (np.load(tmp_path / "t.npy") == tokens).all() and tokens.max() < 50257
    # GPT-2's ids of a known phrase
    assert bench_prefill.gpt2(bench_prefill.RANKS_CACHE).encode_ordinary("Hello world") == [15496, 995]


@pytest.fixture(scope="module")
def tiny_qwen4_exp():
    """A 3-layer Qwen4Exp as ple-bench-prefill builds it, in float32 on the
    CPU, with an indexer budget small enough that its queries choose among
    blocks (8 blocks of 4 keys)."""
    pytest.importorskip("transformers.models.qwen4_exp", reason="transformers has no Qwen4Exp")
    from transformers import Qwen4ExpForCausalLM

    from ple_tools import prefill_model

    config = prefill_model.flash_next_config(layers=3, experts=2, hidden=64, base=1000, shards=8,
                                             hashing=bench_prefill.FLASH_NEXT)
    config.indexer_budget = 32
    torch.manual_seed(0)
    return Qwen4ExpForCausalLM(config).eval()


def qsa_indexer(model):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    return next(m for m in model.modules() if isinstance(m, Qwen4ExpTextQSAIndexer))


def indexer_calls(model, batched: bool, run) -> tuple[list, object, int]:
    """Runs ``run()`` with the model's QSA indexer transformers' own or
    batched; returns the indexer's inputs and output of each call, what
    ``run`` returned, and how many times it pooled blocks' keys (transformers'
    loop pools them once a query, the batched indexer once a row of the batch)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    from ple_tools import prefill_model

    indexer = qsa_indexer(model)
    calls, poolings = [], []
    indexer.__class__ = prefill_model.batched_qsa_indexer() if batched else Qwen4ExpTextQSAIndexer
    hooks = [indexer.register_forward_hook(lambda m, args, out: calls.append((args, out))),
             indexer.k_layernorm.register_forward_hook(lambda m, args, out: poolings.append(1))]
    try:
        with torch.no_grad():
            out = run()
    finally:
        for hook in hooks:
            hook.remove()
        indexer.__class__ = Qwen4ExpTextQSAIndexer
    return calls, out, len(poolings)


def test_the_batched_qsa_indexer_keeps_the_keys_transformers_keeps(tiny_qwen4_exp):
    """A chunked prefill (the cache's keys come first) and a left-padded
    batch: every selection mask and the logits equal transformers' loop,
    which the batched indexer does not take for them."""
    model = tiny_qwen4_exp
    prompt = torch.randint(1, 50_000, (1, 150), generator=torch.Generator().manual_seed(1))
    padded = torch.randint(1, 50_000, (2, 90), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(padded)
    mask[1, :37] = 0

    def chunked():
        out = model.generate(prompt, prefill_chunk_size=64, max_new_tokens=3, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        return torch.stack(out.logits)

    def batch():
        return model(padded, attention_mask=mask).logits

    # The prompt's 3 chunks and 2 decode steps, each pooling once; the batch's
    # one forward, pooling once a row.
    for run, forwards, poolings in ((chunked, 5, 5), (batch, 1, 2)):
        ours, our_logits, our_poolings = indexer_calls(model, True, run)
        theirs, their_logits, their_poolings = indexer_calls(model, False, run)
        assert len(ours) == len(theirs) == forwards and our_poolings == poolings < their_poolings
        for (_, a), (_, b) in zip(ours, theirs):
            assert a.dtype == torch.bool and torch.equal(a, b)
        assert torch.equal(our_logits, their_logits)
    # Queries past the budget chose among blocks: not every visible key is kept.
    (args, selected), = theirs
    assert (selected.sum(-1) < args[2].sum(-1)).any()


def test_the_batched_qsa_indexer_takes_transformers_loop_for_other_masks(tiny_qwen4_exp):
    """A mask whose queries see windows, not prefixes of one order, goes
    through transformers' loop and so gives its selection."""
    model = tiny_qwen4_exp
    prompt = torch.randint(1, 50_000, (1, 60), generator=torch.Generator().manual_seed(3))
    causal = torch.ones(60, 60, dtype=torch.bool).tril()
    windows = (causal & ~causal.tril(-41)).view(1, 1, 60, 60)
    (args, _), = indexer_calls(model, False, lambda: model(prompt))[0]
    indexer = qsa_indexer(model)
    args = (*args[:2], windows, *args[3:])
    theirs, _, _ = indexer_calls(model, False, lambda: indexer(*args))
    ours, _, poolings = indexer_calls(model, True, lambda: indexer(*args))
    assert poolings > 1 and torch.equal(ours[0][1], theirs[0][1])
    assert not torch.equal(theirs[0][1], windows)


def test_a_thread_profile_names_ples_threads_and_splits_the_chunks(quick, tokens_file):
    _, _, table = quick
    out = tokens_file.parent / "profile.json"
    proc = run_tool("--table", table, "--tokens", tokens_file, "--tokens-count", TOKENS,
                    "--shards", 6, "--files", 4, "--arms", "lookahead", "--compute-ms", 50,
                    "--device", "cpu", "--thread-profile", "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())["results"]["arms"]
    profile = record["thread_profile"]
    assert {"main", "ple-prefetch"} <= set(profile["groups"])
    assert profile["samples"]["reads"] > 0 and profile["samples"]["compute"] > 0
    assert profile["groups"]["main"]["cpu_s"]["compute"] > 0  # the busy compute stand-in
    assert record["warm_up_s"] > 0 and record["prefetch_hits"] == 2
    assert "lookahead: its threads' CPU while its chunks ran" in proc.stdout
    assert "more than the CPUs in" in proc.stdout


def test_the_phases_of_the_chunks():
    layer = [{"t_start": 1.0, "t_forward_end": 1.5, "t_end": 2.0}]
    assert bench_prefill.chunk_phases(layer) == [(1.0, 1.5, "reads"), (1.5, 2.0, "compute")]
    model = [{"t_start": 1.0, "t_end": 2.0, "in_ple": [[1.2, 1.3]]},
             {"t_start": 2.0, "t_end": 3.0, "in_ple": [[2.0, 2.1], [2.5, None]]}]
    assert bench_prefill.chunk_phases(model) == [
        (1.0, 1.2, "model"), (1.2, 1.3, "in_ple"), (1.3, 2.0, "model"),
        (2.0, 2.1, "in_ple"), (2.1, 2.5, "model"), (2.5, 3.0, "in_ple")]


def test_the_warm_up_runs_a_chunk_of_every_shape(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(5000, dtype=np.int64))
    spec = {"tokens_path": str(tokens), "chunk": 2048}
    # The first chunk, a full one after it, and the last one's 904 tokens.
    assert len(bench_prefill.warm_up_tokens(spec)) == 2 * 2048 + 904
    np.save(tokens, np.arange(4096, dtype=np.int64))
    assert len(bench_prefill.warm_up_tokens(spec)) == 4096
    np.save(tokens, np.arange(1000, dtype=np.int64))
    assert len(bench_prefill.warm_up_tokens(spec)) == 1000
