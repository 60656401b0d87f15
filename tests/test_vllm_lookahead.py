"""Lookahead under vLLM (ple.integrations.vllm.lookahead, docs/vllm.md): the
tiny Gemma 3n of test_vllm through ``vllm.LLM`` on the CPU, its prompts
longer than ``max_num_batched_tokens`` so that vLLM prefills them in
chunks, with ``PLE_LOOKAHEAD_MIB`` on and off, and on over direct I/O with a
row cache: the same bits, and the coming chunks' rows taken from prefetches.  Through a stand-in worker: forwards
padded as CUDA graphs pad them hit within the bound, forwards of other ids
leave nothing held, on the CPU and on CUDA (skipped without a GPU).  Needs
vLLM (``make test-vllm``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
pytest.importorskip("transformers")

from helpers import write_arange_table  # noqa: E402
from test_vllm import TIMEOUT_S, assert_same_outputs, gemma, session_results  # noqa: E402, F401

import ple  # noqa: E402
from ple.integrations.vllm import lookahead  # noqa: E402
from ple.layers import DiskEmbedding  # noqa: E402

# vLLM schedules at most CHUNK tokens a step: LONG is prefilled in 7 chunks
# (6 of them read ahead), OTHER in 6.
CHUNK = 16
LONG = [(7 * i + 3) % 1000 for i in range(100)]
OTHER = [(11 * i + 5) % 1000 for i in range(90)]
MAX_TOKENS = 4

# One process, an engine per arm (in-process, eager), each arm's environment
# set before its engine is built.  Each arm generates LONG alone, then LONG
# and OTHER together, and reports the tokens, the logprobs as float.hex
# (bits) and the table's counters of each; an arm with "refused" expects its
# engine to raise and reports the message.
SESSION = r"""
import json, os, sys

def stats(model):
    from ple.layers import DiskEmbedding
    (module,) = [m for m in model.modules() if isinstance(m, DiskEmbedding)]
    counters = module.table.stats()
    module.table.reset_stats()
    return counters

def main():
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, logprobs=3,
                            detokenize=False)
    for arm in spec["arms"]:
        os.environ.update(arm["env"])
        options = {"skip_tokenizer_init": True, "dtype": "float32", "seed": 0,
                   "max_model_len": 128, "max_num_seqs": 4, "gpu_memory_utilization": 0.1,
                   "enforce_eager": True, "enable_chunked_prefill": True,
                   "max_num_batched_tokens": spec["chunk"], "enable_prefix_caching": False,
                   **spec["llm"]}
        try:
            llm = LLM(model=spec["model"], **options)
        except Exception as error:
            print("RESULT " + json.dumps({"name": arm["name"], "refused": str(error)}), flush=True)
            continue
        llm.apply_model(stats)  # the profile run's gathers
        result = {"name": arm["name"]}
        for batch, prompts in spec["batches"].items():
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            result[batch] = {
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "logprobs": [[{str(k): v.logprob.hex() for k, v in step.items()}
                              for step in o.outputs[0].logprobs] for o in outputs],
                "stats": llm.apply_model(stats)[0]}
        print("RESULT " + json.dumps(result), flush=True)
        del llm

main()
"""


def run_arms(model, arms: list[dict], directory, **llm) -> dict:
    """Runs the arms (each an engine in-process, eager unless ``llm``, vLLM's
    options, say otherwise) in one new interpreter: {arm name: result}."""
    spec = {"model": str(model), "arms": arms, "chunk": CHUNK, "max_tokens": MAX_TOKENS,
            "batches": {"alone": [LONG], "together": [LONG, OTHER]}, "llm": llm}
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PLE_OFFLOAD": "auto",
                   "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    session = directory / "vllm_lookahead_session.py"
    session.write_text(SESSION)
    done = subprocess.run([sys.executable, str(session), json.dumps(spec)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=environment, cwd=directory)
    results, _ = session_results(done, arms)
    return {name: {key: value for key, value in result.items() if key != "name"}
            for name, result in results.items()}


@pytest.fixture(scope="module")
def arms(gemma, tmp_path_factory) -> dict:
    return run_arms(gemma, [
        {"name": "off", "env": {"PLE_LOOKAHEAD_MIB": "0"}},
        {"name": "on", "env": {"PLE_LOOKAHEAD_MIB": "64"}},
        {"name": "direct", "env": {"PLE_LOOKAHEAD_MIB": "64", "PLE_GATHER_IO": "direct",
                                   "PLE_GATHER_ROW_CACHE_MIB": "4"}},
        {"name": "bad", "env": {"PLE_LOOKAHEAD_MIB": "lots"}},
    ], tmp_path_factory.mktemp("lookahead"))



def test_a_chunked_prefill_gives_the_same_bits_with_lookahead(arms):
    for batch in ("alone", "together"):
        assert_same_outputs({"name": "on", **arms["on"][batch]}, {"name": "off", **arms["off"][batch]})


def test_a_lone_prompts_coming_chunks_come_from_prefetches(arms):
    """LONG alone: its 7 chunks' gathers, all but the first served by a
    prefetch (the first finds the others' pending: a miss), then 3 decode
    steps; nothing prefetched with lookahead off."""
    on, off = arms["on"]["alone"]["stats"], arms["off"]["alone"]["stats"]
    assert (on["prefetch_hits"], on["prefetch_misses"]) == (6, 1)
    assert (off["prefetch_hits"], off["prefetch_misses"]) == (0, 0)
    assert on["rows"] == off["rows"] == len(LONG) + MAX_TOKENS - 1


def test_lookahead_over_direct_io_and_a_row_cache(arms):
    """PLE_GATHER_IO=direct with a row cache: the same bits and the same
    prefetch hits as lookahead over the page cache, the rows read ahead
    held pinned in the row cache until taken."""
    for batch in ("alone", "together"):
        assert_same_outputs({"name": "direct", **arms["direct"][batch]},
                            {"name": "off", **arms["off"][batch]})
    direct, on = arms["direct"]["alone"]["stats"], arms["on"]["alone"]["stats"]
    assert (direct["prefetch_hits"], direct["prefetch_misses"]) == (6, 1)
    assert direct["rows"] == on["rows"]
    assert direct["prefetch_pinned_rows"] > 0 and direct["direct_reads"] > 0
    assert on["prefetch_pinned_rows"] == 0


def test_two_requests_read_ahead_while_one_is_alone(arms):
    """LONG and OTHER together: LONG's chunks 2 to 6 come from prefetches;
    the step that batches LONG's last chunk with OTHER's first finds other
    ids (a miss, its rows read by the forward) and the lookahead stops while
    both are held; once LONG finished, OTHER's last two chunks come from
    prefetches.  LONG's last chunk, read ahead but not taken, was read twice."""
    on, off = arms["on"]["together"]["stats"], arms["off"]["together"]["stats"]
    assert (on["prefetch_hits"], on["prefetch_misses"]) == (5 + 2, 2)
    assert (off["prefetch_hits"], off["prefetch_misses"]) == (0, 0)
    assert on["rows"] == off["rows"] + len(LONG) % CHUNK


def test_a_bad_lookahead_setting_is_refused(arms):
    assert arms["bad"] == {"refused": "ple: PLE_LOOKAHEAD_MIB must be MiB of rows read ahead, an "
                                      "integer in [0, 256] (0: no lookahead), not 'lots'"}


# Stand-ins for vLLM's SchedulerOutput, as the worker gets it.
def step(new=(), cached=(), finished=()):
    """``new``: (request id, prompt, tokens scheduled); ``cached``: (request
    id, tokens computed, tokens scheduled)."""
    scheduled = {req_id: n for req_id, _, n in new} | {req_id: n for req_id, _, n in cached}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=p, prompt_embeds=None,
                                            num_computed_tokens=0) for r, p, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              num_computed_tokens=[c for _, c, _ in cached],
                                              resumed_req_ids=set()),
        num_scheduled_tokens=scheduled, finished_req_ids=set(finished), preempted_req_ids=set())


def stand_in_worker(model, embedding, chunk_tokens=4, device="cpu"):
    """A stand-in for vLLM's worker over ``model``, chunks of ``chunk_tokens`` tokens."""

    class Worker:  # the lookahead keeps a weak reference to its worker
        vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(
            max_num_scheduled_tokens=None, max_num_batched_tokens=chunk_tokens))
        model_runner = SimpleNamespace(get_model=lambda: model)

    Worker.embedding = embedding
    Worker.device = torch.device(device)
    return Worker()


@pytest.fixture
def worker(tmp_path, monkeypatch):
    """A stand-in worker over a model holding a DiskEmbedding of a 64-row
    table of 4 float32 (16 B rows)."""
    table = ple.Table.from_safetensors(write_arange_table(tmp_path / "t.safetensors", 64, 4), "t")
    model = torch.nn.Sequential(DiskEmbedding(table))
    monkeypatch.setenv("PLE_LOOKAHEAD_MIB", "1")
    yield stand_in_worker(model, model[0])
    table.close()


def forward(worker, ids):
    """What vLLM's step runs: the gather of the batch's ids, those outside
    the table as 0 (as Gemma 3n's per-layer inputs)."""
    ids = torch.tensor(ids)
    return lambda _: worker.embedding(torch.where(ids < 64, ids, 0))


def first_values(tokens):
    """Column 0 of the rows of ``tokens`` (row i holds 4 * i, ...)."""
    return torch.tensor([4.0 * i if i < 64 else 0.0 for i in tokens])


PROMPT = list(range(60, 70))  # 10 tokens, 60 to 69: ids 64 to 69 are gathered as 0


def test_each_chunk_of_a_lone_prompt_is_read_ahead(worker):
    gathered = [lookahead.run_step(worker, step(new=[("a", PROMPT, 4)]), forward(worker, PROMPT[:4]))]
    for start in (4, 8):
        stop = min(start + 4, len(PROMPT))
        gathered.append(lookahead.run_step(worker, step(cached=[("a", start, stop - start)]),
                                           forward(worker, PROMPT[start:stop])))
    stats = worker.embedding.table.stats()
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (2, 1)
    assert torch.equal(torch.cat(gathered)[:, 0], first_values(PROMPT))


def test_a_batched_step_drops_what_was_read_ahead(worker):
    table = worker.embedding.table
    lookahead.run_step(worker, step(new=[("a", PROMPT, 4)]), forward(worker, PROMPT[:4]))
    # "b" joins: the batch's ids are not a's next chunk alone.
    batch = PROMPT[4:8] + [1, 2]
    rows = lookahead.run_step(worker, step(new=[("b", [1, 2], 2)], cached=[("a", 4, 4)]),
                              forward(worker, batch))
    assert torch.equal(rows[:, 0], first_values(batch))
    # Dropped before the batch's gather, which found nothing pending: only
    # the first step's gather missed (it found a's next chunks pending).
    stats = table.stats()
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (0, 1)


def test_every_request_that_ends_is_forgotten(worker):
    """Requests that end together are all forgotten: after 240 requests
    finished in batches of 4 the planner holds no prompt (it held 180)."""
    planner = lookahead._lookahead_of(worker)
    for batch in range(60):
        ids = [f"r{batch}-{i}" for i in range(4)]
        lookahead.run_step(worker, step(new=[(r, PROMPT[:2], 2) for r in ids]),
                           forward(worker, PROMPT[:2] * 4))
        lookahead.run_step(worker, step(finished=ids), lambda _: None)
    assert planner.prompts == {} and planner.held == set()


def test_a_failed_prefetch_only_loses_the_overlap(worker, monkeypatch):
    """The step runs, the failure is logged once, the lookahead is off."""
    monkeypatch.setattr(ple.Table, "prefetch", mock.Mock(side_effect=OSError("no more reads")))
    with mock.patch.object(lookahead, "logger") as logger:
        for start in (0, 4):
            schedule = (step(new=[("a", PROMPT, 4)]) if start == 0
                        else step(cached=[("a", start, 4)]))
            rows = lookahead.run_step(worker, schedule, forward(worker, PROMPT[start:start + 4]))
            assert torch.equal(rows[:, 0], first_values(PROMPT[start:start + 4]))
    assert logger.warning.call_count == 1
    assert ple.Table.prefetch.call_count == 1


def test_an_ngram_tables_coming_chunks_are_read_ahead(tmp_path, monkeypatch):
    """Qwen4Exp's n-gram module: each chunk's hashed ids, the tokens before
    it as context (EOS before the prompt, as vLLM's ngram_context holds
    them), are read ahead and taken by the chunk's gather, with the rows of
    the gathers without lookahead."""
    from ple.layers import NGramEmbedding
    from ple.layers.ngram_ids import NGramHashing
    from ple_tools.make_table import PREFIX, ensure_table

    hashing = NGramHashing(vocab_size=100, eos_id=1, base_size=1000, ngram_size=3,
                           heads_per_ngram=2, seed=7)
    ensure_table(tmp_path / "ngram", rows=hashing.padded_rows(128), row_bytes=16, shards=1,
                 files=1)
    prompt = [5, 1, 7, 8, 9, 10, 11, 12, 13, 14]  # an EOS inside
    starts = range(0, len(prompt), 4)

    def chunk_args(start):
        before = prompt[max(0, start - 2):start]
        return (torch.tensor(prompt[start:start + 4]), None,
                torch.tensor([[1] * (2 - len(before)) + before]))

    with ple.Table.from_safetensors(tmp_path / "ngram", PREFIX) as table:
        layer = NGramEmbedding(table, hashing)
        without = torch.cat([layer(*chunk_args(start)) for start in starts])
        table.reset_stats()
        monkeypatch.setenv("PLE_LOOKAHEAD_MIB", "1")
        worker = stand_in_worker(torch.nn.Sequential(layer), layer)
        gathered = []
        for start in starts:
            n = min(4, len(prompt) - start)
            scheduled = (step(new=[("a", prompt, n)]) if start == 0
                         else step(cached=[("a", start, n)]))
            args = chunk_args(start)
            gathered.append(lookahead.run_step(worker, scheduled, lambda _, args=args: layer(*args)))
        stats = table.stats()
        assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (2, 1)
        assert torch.equal(torch.cat(gathered).view(torch.int16), without.view(torch.int16))


# A prompt through a stand-in worker over 4,096 rows of 1 KiB, in chunks of
# WIDE_CHUNK tokens (256 KiB of rows) with PLE_LOOKAHEAD_MIB=1: four chunks
# ahead at most.  The last chunk is partial.
WIDE_ROWS, WIDE_COLS, WIDE_CHUNK = 4096, 256, 256
WIDE_PROMPT = [(37 * i + 11) % WIDE_ROWS for i in range(16 * WIDE_CHUNK - 96)]
BOUND = 1 << 20


@pytest.fixture
def wide_table(tmp_path, monkeypatch):
    monkeypatch.setenv("PLE_LOOKAHEAD_MIB", "1")
    path = write_arange_table(tmp_path / "wide.safetensors", WIDE_ROWS, WIDE_COLS)
    with ple.Table.from_safetensors(path, "t") as table:
        yield table


def prefill(worker, prompt, forwarded_ids, device="cpu"):
    """Runs the prompt's chunks through ``worker``, each forward gathering
    ``forwarded_ids(start, stop)``; returns the rows of the chunks' own
    tokens and what the table held after each step, then ends the request."""
    table = worker.embedding.table
    rows, held = [], []
    for start in range(0, len(prompt), WIDE_CHUNK):
        n = min(WIDE_CHUNK, len(prompt) - start)
        schedule = (step(new=[("a", prompt, n)]) if start == 0
                    else step(cached=[("a", start, n)]))
        ids = torch.tensor(forwarded_ids(start, start + n), device=device)
        rows.append(lookahead.run_step(worker, schedule, lambda _: worker.embedding(ids))[:n])
        held.append(table.prefetched_bytes())
    if device == "cuda":
        torch.cuda.synchronize()  # vLLM has sampled the last step's token when it finishes
    lookahead.run_step(worker, step(finished=["a"]), lambda _: None)
    return torch.cat(rows).cpu(), held


class GraphPadding:
    """The ids a CUDA graph's forward gathers: the step's ids, then what the
    runner's persistent buffer holds after them, up to the next of the
    graph sizes (vLLM pads a step's tokens so)."""

    SIZES = (64, 128, 192, 320, 512)

    def __init__(self, prompt):
        self.prompt = prompt
        self.buffer = [0] * self.SIZES[-1]

    def __call__(self, start, stop):
        n = stop - start
        self.buffer[:n] = self.prompt[start:stop]
        return self.buffer[:next(size for size in self.SIZES if size >= n)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_forwards_padded_as_cuda_graphs_pad_them_hit_within_the_bound(wide_table, device):
    """Each chunk's gather, padded, takes the rows read ahead for it (all
    but the first, which finds the others pending); the table never holds
    more than the bound, and nothing once the request has finished."""
    embedding = DiskEmbedding(wide_table)
    worker = stand_in_worker(torch.nn.Sequential(embedding), embedding, WIDE_CHUNK, device)
    rows, held = prefill(worker, WIDE_PROMPT, GraphPadding(WIDE_PROMPT), device)
    assert torch.equal(rows[:, 0], torch.tensor(WIDE_PROMPT, dtype=torch.float32) * WIDE_COLS)
    stats = wide_table.stats()
    chunks = -(-len(WIDE_PROMPT) // WIDE_CHUNK)
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (chunks - 1, 1)
    assert max(held) <= BOUND
    assert wide_table.prefetched_bytes() == 0


def test_forwards_of_other_ids_leave_nothing_held(wide_table):
    """Forwards of the chunks' sizes but other ids: the first read ahead
    leaves its rows untaken, what was read ahead is dropped and the request
    is read ahead no more."""
    embedding = DiskEmbedding(wide_table)
    worker = stand_in_worker(torch.nn.Sequential(embedding), embedding, WIDE_CHUNK)
    other = [(i + 1) % WIDE_ROWS for i in WIDE_PROMPT]
    rows, held = prefill(worker, WIDE_PROMPT, lambda start, stop: other[start:stop])
    assert torch.equal(rows[:, 0], torch.tensor(other, dtype=torch.float32) * WIDE_COLS)
    assert held[0] == BOUND and held[1:] == [0] * (len(held) - 1)
    assert wide_table.stats()["prefetch_hits"] == 0
