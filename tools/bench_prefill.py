"""A long prompt of real text through the Flash-Next n-gram layer, chunked,
cold, each arm in a child process of its own (optionally under a memory
cgroup), each bounded in time.

    ple-bench-prefill [--table DIR] [--ngram-base 20000000] [--shards 128] [--files 32]
                      [--tokens-count 184134] [--chunk 2048] [--text PATH | --tokens PATH]
                      [--ranks PATH] [--caches 512] [--compute-ms N] [--device cpu|cuda]
                      [--model-layers N [--model-hidden 2048] [--model-experts 64]]
                      [--memory-limit MiB --ballast MiB] [--deadline S] [--arms A,...]
                      [--thread-profile] [--json PATH] [--quick]
    (or python tools/bench_prefill.py ...)

The layer is ``ple.layers.NGramEmbedding`` with Flash-Next's hashing
(vocab 248,320, EOS 248,044, 3-grams, 8 heads per n-gram, seed 1234: 16 rows
a token) over a table of random FP8 rows of 160 B written by
ple_tools.make_table (its rows: the hashing's, padded to 128; the default
base 20,000,000 gives the reference table, 320,001,536 rows in 128 shards
over 32 files, 51.2 GB).  The prompt runs as forwards of --chunk tokens,
each given the two tokens before it as context, as a chunked prefill does.

Arms (--arms, in this order by default):

  window          the default GatherConfig (the bounded prefetch window)
  all             GatherConfig.from_spec("all"): every cold page advised first
  direct          GatherConfig(io="direct"): O_DIRECT reads, no page cache
  direct-cache:MiB  direct with a row cache of MiB (one arm per --caches value)
  lookahead       the window, with layer.lookahead(layer.row_ids(prompt), chunk)
                  before the first chunk and end_lookahead() after the last:
                  the rows of the coming chunks are read while the current
                  one computes
  lookahead-direct-cache:MiB   lookahead over direct I/O with a row cache
                  of MiB (one arm per --caches value; lookahead-<arm> runs
                  lookahead over any arm above)

--model-layers N runs the arms through a Qwen4Exp-shaped model of N decoder
layers with random weights (ple_tools.prefill_model: transformers'
Qwen4ExpForCausalLM with its QSA indexer batched over the queries,
--model-hidden wide, --model-experts experts, in bfloat16 on --device) whose
PLE layer is the n-gram layer above, its table served by ple: each arm is
``model.generate(prompt, prefill_chunk_size=--chunk, max_new_tokens=1)``,
timed to its first token, as a user of ple's transformers integration runs
it.  The arms then are:

  compute         compute alone: the model with a small n-gram table of its
                  own (base 1,000) in device memory, no reads
  reads           reads alone: the layer's forwards over the chunks, no model
  reads-direct-cache:MiB   reads alone through direct I/O with a row cache
                  (reads-<arm>: through any arm's reader)
  window, all, direct, direct-cache:MiB   the model, no lookahead
                  (lookahead_mib=0)
  lookahead       the model as loaded by default: generate looks ahead
                  (lookahead_mib=--lookahead-mib)
  lookahead-direct-cache:MiB   the same over direct I/O with a row cache

Each arm's child warms up before the arm enters its memory cgroup (its
CUDA context, weights and libraries are not charged to it, nor timed):
compiles, kernel choices and libraries are per process, so every child
runs a chunk of each shape its arm will (the first, a full one after
others, the last) before it is timed.  An arm that reads the table does so
through the same model (or layer), reader and lookahead over a small table
of its own (base 1,000, written once per run in a temporary directory), so
that it reads nothing the arm will read; the compute arm warms up on its
own model.  The arms through the model must give the same first token and
logits (their SHA-256), the reads arms the same rows as the arms of the
layer alone.

Before each arm the table's pages are dropped from the page cache.  Under
--memory-limit each arm's child runs in a memory cgroup (tools/cgroup.py:
memory.high = the limit, plus the row cache's MiB for a direct-cache arm)
with --ballast MiB of touched anonymous memory.  An arm still running after
--deadline seconds is killed and reported as timed out, with the chunks it
had done, their times and what it had read by the last of them (bytes,
prefetch hits); every arm is printed as it ends.

--compute-ms N runs a busy compute stand-in after each chunk's forward
(CUDA: matmuls calibrated to N ms, then a synchronize; CPU: a busy loop of
N ms): a chunk then costs its reads plus its compute, or, with lookahead,
about the larger of them.  For each lookahead arm the tool prints compute
alone and reads alone (its reader's arm's compute and forward times), no
lookahead (that arm's total) and lookahead, with the goal ratios: over the
window, lookahead over no lookahead (goal <= 0.6) and over max(compute,
reads) (goal <= 1.15); over another reader, lookahead over max(compute,
reads) (goal <= 1.05), and its time and bytes read over lookahead over the
window's (goals <= 0.75 and <= 0.25); through a model also the least time
any overlap of the chunks takes (the compute and reads arms' chunks, the
reads back to back from the start, a chunk computing once its reads and the
chunk before are done) and lookahead over it.
Through a model, where one of those arms timed out, it prints the same
ratios over the first chunks that they all finished, as not the goals.

--thread-profile samples each arm's child every 10 ms from this process
(/proc/PID/task/*/stat: ple_tools.thread_profile; the child pays nothing)
and reports, per group of its threads (by name: the main thread; ple's
ple-gather, ple-prefetch, ple-io, ple-doorbell; CUDA's and torch's), their
CPU seconds in each phase of the chunks (through a model: the main thread
inside ple's layer, and the rest of the chunk; the layer alone: its
forward, and the compute after it), and how often more of the child's
threads were runnable than the CPUs it may use.

Per arm: time (total, forwards, compute, per chunk: the median, the first
and the largest), the warm-up's time, distinct pages the
gathers touched (summed over chunks: Table.stats' unique_pages) against the
prompt's distinct pages, bytes read from disk (/proc/self/io: the whole
process's, its libraries' too), major faults, row-cache hits, prefetch hits
(docs/counters.md), in the JSON document the bytes of the table's pages
that the arm brought into the page cache (``table_cached_bytes``: mincore
of the table's files before and after the arm; direct reads bypass it, and
a page read and evicted again is not counted), the SHA-256 of the
output rows (bf16, in prompt order), and under --memory-limit the cgroup's
peak and the seconds its tasks stalled on memory (PSI: reclaim, and
memory.high's throttling, which can hold a task for up to 2 s).  Every
finished arm must give the same SHA-256: the tool exits 1 when they differ
or an arm fails (a timed-out arm is reported, not failed).

Real text: the first --tokens-count tokens of --text (default: the running
Python's own documentation, ``pydoc_data.topics`` followed by the stdlib's
module, class and function docstrings; it differs between Python versions,
so a run that must repeat another machine's tokens passes the same --text
file, or --tokens) with GPT-2's BPE (tiktoken, the ``bench`` extra), whose
ranks are ``whisper/assets/gpt2.tiktoken`` in openai-whisper's source
distribution: --ranks PATH, else ~/.cache/ple/gpt2.tiktoken, which the tool
makes, when missing, with ``pip download --no-binary :all: openai-whisper==
20250625`` (a download; its SHA-256 is checked).  --save-text PATH and
--save-tokens PATH write what was used.  The text, tokenizer, ranks' SHA-256
and token count are in the report.

--quick: a table of about 262,000 rows (base 16,384, 8 shards over 4 files),
8,192 tokens, caches 16 MiB (lookahead-direct-cache:16 among the arms),
deadline 120 s: a run of well under a minute.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import mmap
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from ple_tools.argtypes import (MAX_ROW_CACHE_MIB, InputFile, OutputFile, lookahead_mib,
                                milliseconds, non_negative_int, positive_int,
                                refuse_over_memory, row_cache_mib_list, seconds, size)
from ple_tools.figures import add_json_option, parse_with_defaults, run_recorded
from ple_tools.make_table import refuse_directory, refuse_table

MiB = 2**20
# Flash-Next's n-gram hashing (vocab, EOS, 3-grams of 8 heads, seed 1234): PLE layer 0.
FLASH_NEXT = dict(vocab_size=248320, eos_id=248044, ngram_size=3, heads_per_ngram=8, seed=1234)
PAD_TO = 128  # make_ngram_vocab_size_divisible_by
DEFAULTS = dict(ngram_base=20_000_000, shards=128, files=32, tokens_count=184_134,
                caches="512", deadline=300.0, table=Path("data/bench_prefill"))
QUICK = dict(ngram_base=16_384, shards=8, files=4, tokens_count=8_192, caches="16",
             deadline=120.0, table=Path("data/bench_prefill_quick"))
WINDOW, LOOKAHEAD = "window", "lookahead"
COMPUTE, READS = "compute", "reads"  # the arms of compute alone and reads alone (--model-layers)

WHISPER = "openai-whisper==20250625"
RANKS_MEMBER = "whisper/assets/gpt2.tiktoken"
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
RANKS_CACHE = Path("~/.cache/ple/gpt2.tiktoken").expanduser()
GPT2_END = {"<|endoftext|>": 50256}


# -- the text and its tokens ------------------------------------------------

def python_docs(min_chars: int) -> str:
    """The running Python's documentation as prose: every pydoc topic (in
    key order), then the docstrings of the stdlib's modules, classes and
    functions (files in path order, tests left out), until `min_chars`."""
    from pydoc_data.topics import topics

    parts = [topics[key] for key in sorted(topics)]
    size = sum(map(len, parts))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if size >= min_chars:
            break
        if {"test", "tests", "site-packages", "idle_test"} & set(path.relative_to(stdlib).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(doc)
                    size += len(doc)
    return "\n\n".join(parts)


def fetch_ranks(dest: Path) -> None:
    """GPT-2's BPE ranks out of openai-whisper's source distribution (pip
    download, no install), checked against their known SHA-256."""
    import tarfile

    print(f"downloading {WHISPER} (source) for GPT-2's BPE ranks into {dest}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", WHISPER, "-d", tmp], check=True, timeout=300)
        (archive,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(RANKS_MEMBER))
            data = tar.extractfile(member).read()
    if hashlib.sha256(data).hexdigest() != RANKS_SHA256:
        raise RuntimeError(f"{member.name} in {archive.name} is not the known gpt2.tiktoken")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)


def gpt2(ranks: Path):
    """tiktoken's Encoding of GPT-2 (r50k_base) from a local ranks file."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str,
                             mergeable_ranks=load_tiktoken_bpe(str(ranks)),
                             special_tokens=GPT2_END)


def prompt_tokens(args) -> tuple["np.ndarray", dict]:
    """The prompt's token ids (int64) and a record of where they came from."""
    import numpy as np

    if args.tokens:
        tokens = np.load(args.tokens).astype(np.int64).ravel()[:args.tokens_count]
        source = {"tokens_file": str(args.tokens)}
    else:
        ranks = args.ranks or RANKS_CACHE
        if not ranks.is_file():
            if args.ranks:
                raise SystemExit(f"error: no ranks file at {ranks}")
            fetch_ranks(ranks)
        if args.text:
            text, text_name = args.text.read_text(encoding="utf-8"), str(args.text)
        else:
            # about 3.4 characters a GPT-2 token in this prose: ask for 5 to be sure
            text = python_docs(5 * args.tokens_count)
            text_name = f"Python {sys.version.split()[0]} docs (pydoc_data.topics, stdlib docstrings)"
        if args.save_text:
            args.save_text.write_text(text, encoding="utf-8")
        tokens = np.array(gpt2(ranks).encode_ordinary(text)[:args.tokens_count], dtype=np.int64)
        source = {"text": text_name, "text_chars": len(text),
                  "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
                  "tokenizer": "GPT-2 BPE (tiktoken r50k_base)",
                  "ranks_sha256": hashlib.sha256(ranks.read_bytes()).hexdigest()}
    if len(tokens) < args.tokens_count:
        raise SystemExit(f"error: the text gives {len(tokens):,} tokens, fewer than "
                         f"--tokens-count {args.tokens_count:,}")
    if args.save_tokens:
        np.save(args.save_tokens, tokens)
    # the same figure on two machines means the same prompt
    source.update(tokens=len(tokens), tokens_sha256=hashlib.sha256(tokens.tobytes()).hexdigest())
    return tokens, source


# -- the arms ----------------------------------------------------------------

def hashing_of(base: int):
    from ple.layers.ngram_ids import NGramHashing

    return NGramHashing(**FLASH_NEXT, base_size=base)


def split_arm(arm: str) -> tuple[str, str | None]:
    """An arm's way of running (COMPUTE, READS, LOOKAHEAD, or "" for the
    reader alone) and its reader (None for COMPUTE): ``lookahead`` and
    ``reads`` run the window, ``lookahead-<reader>`` and ``reads-<reader>``
    another reader."""
    if arm == COMPUTE:
        return COMPUTE, None
    for way in (LOOKAHEAD, READS):
        if arm == way:
            return way, WINDOW
        if arm.startswith(way + "-"):
            return way, arm.removeprefix(way + "-")
    return "", arm


def arm_name(way: str, reader: str) -> str:
    """split_arm's inverse."""
    if not way:
        return reader
    return way if reader == WINDOW else f"{way}-{reader}"


def arm_config(arm: str):
    """The GatherConfig of an arm's reader (None for COMPUTE); KeyError or
    ValueError for an arm that names none."""
    import ple

    _, reader = split_arm(arm)
    if reader is None:
        return None
    kind, _, value = reader.partition(":")
    if kind == "direct-cache":
        return ple.GatherConfig(io="direct", row_cache_mib=int(value))
    return {WINDOW: ple.GatherConfig(), "all": ple.GatherConfig.from_spec("all"),
            "direct": ple.GatherConfig(io="direct")}[reader]


def cache_mib(arm: str) -> int:
    _, reader = split_arm(arm)
    return int(reader.partition(":")[2]) if reader and reader.startswith("direct-cache:") else 0


def looks_ahead(arm: str) -> bool:
    return split_arm(arm)[0] == LOOKAHEAD


def lookahead_available() -> bool:
    from ple.layers import NGramEmbedding

    return hasattr(NGramEmbedding, "lookahead") and hasattr(NGramEmbedding, "end_lookahead")


class BusyCompute:
    """A chunk's compute stand-in of about `ms` milliseconds: on CUDA,
    bf16 matmuls (a count calibrated once) and a synchronize; on a CPU, a
    busy loop (no sleep: the core is taken, as compute takes it)."""

    def __init__(self, ms: float, device: str):
        import torch

        self.ms, self.device, self.steps = ms, device, 0
        if ms <= 0 or device != "cuda":
            return
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.steps = 8
        self.run()  # warm up, then time 8 and scale
        start = time.perf_counter()
        self.run()
        per_step = (time.perf_counter() - start) / 8
        self.steps = max(1, round(ms / 1e3 / per_step))

    def run(self) -> None:
        if self.ms <= 0:
            return
        if self.device == "cuda":
            import torch

            for _ in range(self.steps):
                torch.mm(self.a, self.b)
            torch.cuda.synchronize()
        else:
            end = time.perf_counter() + self.ms / 1e3
            while time.perf_counter() < end:
                pass


def model_of(spec: dict, table_files):
    """The arm's Qwen4Exp-shaped model: over ``table_files`` (None: the
    compute arm's own small table)."""
    import torch

    from ple_tools import prefill_model

    base, files = (spec["ngram_base"], table_files) if table_files else (OWN_TABLE_BASE, None)
    config = prefill_model.flash_next_config(
        layers=spec["model_layers"], experts=spec["model_experts"], hidden=spec["model_hidden"],
        hashing=FLASH_NEXT, base=base, shards=spec["shards"])
    ahead = spec["lookahead_mib"] if looks_ahead(spec["arm"]) else 0
    return prefill_model.build(config, torch.device(spec["device"]), table_files=files,
                               gather_config=None if files is None else arm_config(spec["arm"]),
                               lookahead_mib=ahead)


# The compute arm's own table, and the small table every arm warms up on.
OWN_TABLE_BASE = 1000


def warm_up_tokens(spec: dict) -> "np.ndarray":
    """The warm-up's prompt: the prompt's first two chunks and as many
    tokens as its last chunk has, so that the warm-up runs a chunk of every
    shape the arm will: the first (no cache before it), a full one after
    others, and the last."""
    import numpy as np

    tokens = np.load(spec["tokens_path"])
    chunk = spec["chunk"]
    tail = len(tokens) % chunk
    return tokens[:min(len(tokens), 2 * chunk + tail)]


def warm_up(model, spec: dict) -> None:
    """A chunked prefill of warm_up_tokens, outside the memory cgroup: the
    libraries and kernels the first forwards load (cuBLAS's among them,
    hundreds of MiB of file pages) are not charged to the arm's cgroup, which
    they would throttle, nor timed, and what a first chunk of each shape
    compiles or tunes (Triton's and torch's kernels, on a fresh machine a
    second or more) is done before the arm's first chunk."""
    import torch

    prompt = torch.from_numpy(warm_up_tokens(spec)).view(1, -1).to(spec["device"])
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=1, do_sample=False,
                       prefill_chunk_size=spec["chunk"])
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()


def warm_up_on_own_table(spec: dict) -> None:
    """The warm-up of an arm whose model reads the table: the same model over
    the small warm-up table (``spec["warm_table"]``), read as the arm reads
    (its reader, its lookahead), so that it reads nothing the arm will read;
    the model is dropped after, and its table closed."""
    import gc

    import torch

    from ple.integrations.transformers import close_tables
    from ple_tools.make_table import PREFIX
    from ple_tools.table_layout import Layout

    files = Layout.open(Path(spec["warm_table"]), PREFIX).paths
    model = model_of({**spec, "ngram_base": OWN_TABLE_BASE}, files)
    warm_up(model, spec)
    close_tables(model)
    del model
    gc.collect()
    if spec["device"] == "cuda":
        torch.cuda.empty_cache()


def warm_up_layer(spec: dict) -> None:
    """The layer arms' warm-up: the layer over the small warm-up table, read
    as the arm reads, called on chunks of every shape of the arm's (the first,
    a full one with its context, the last), so that an arm's first chunk is
    not also the process's CUDA start and the decoder's first launch (about
    a second on the H200)."""
    import torch

    import ple
    from ple.layers import NGramEmbedding
    from ple_tools.make_table import PREFIX

    device = torch.device(spec["device"])
    tokens = torch.from_numpy(warm_up_tokens(spec))
    table = ple.Table.from_safetensors(spec["warm_table"], PREFIX, arm_config(spec["arm"]))
    with table:
        layer = NGramEmbedding(table, hashing_of(OWN_TABLE_BASE), dtype=torch.bfloat16)
        ctx = layer.hashing.context_size
        for first in range(0, len(tokens), spec["chunk"]):
            ids = tokens[first:first + spec["chunk"]]
            context = tokens[first - ctx:first].reshape(1, ctx) if first >= ctx else None
            layer(ids.to(device), context=None if context is None else context.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()


def run_model_arm(spec: dict, model, write_line) -> dict:
    """``generate``s one token after the prompt, prefilled in chunks; writes
    a line per chunk's forward (with its start and end, and with
    ``spec["thread_profile"]`` the intervals the main thread spent in ple's
    layers: time.monotonic()); returns the arm's record."""
    import numpy as np
    import torch

    from ple.integrations.transformers import tables
    from ple_tools.demo import disk_read_bytes

    table = next(iter(tables(model).values()), None)
    prompt = torch.from_numpy(np.load(spec["tokens_path"])).view(1, -1).to(spec["device"])
    marks, stamps, gathers = [], [], []

    before = table.stats() if table else {}
    read0 = disk_read_bytes()

    def mark_chunk(*_):
        marks.append(time.perf_counter())
        stamps.append(time.monotonic())
        if len(marks) > 1:
            write_line({"chunk": len(marks) - 2, "forward_s": marks[-1] - marks[-2],
                        "compute_s": 0.0, "reads": reads_record(table, before, read0),
                        "t_start": stamps[-2], "t_end": stamps[-1], "in_ple": gathers[:]})
            gathers.clear()

    hooks = [model.register_forward_pre_hook(mark_chunk)]
    if spec.get("thread_profile"):
        served = tables(model)
        layers = [module for name, module in model.named_modules() if name in served]
        for layer in layers:
            hooks.append(layer.register_forward_pre_hook(
                lambda *_: gathers.append([time.monotonic(), None])))
            hooks.append(layer.register_forward_hook(
                lambda *_: gathers[-1].__setitem__(1, time.monotonic())))
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=1, do_sample=False,
                             prefill_chunk_size=spec["chunk"], return_dict_in_generate=True,
                             output_logits=True)
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    for hook in hooks:
        hook.remove()
    mark_chunk()  # the last chunk's end (generate's one token comes from its logits)
    digest = hashlib.sha256(out.sequences[0, -1:].cpu().numpy().tobytes())
    digest.update(out.logits[0].cpu().view(torch.int16).numpy().tobytes())
    return {"arm": spec["arm"], "seconds": total, "forward_s": total, "compute_s": 0.0,
            **reads_record(table, before, read0), "sha256": digest.hexdigest(),
            "output": "first token" if table else "first token (own table)"}


def reads_record(table, before: dict, read0: int) -> dict:
    """What an arm read since ``before`` (``table.stats()``; {} and no table
    for the compute arm) and ``read0`` (``disk_read_bytes()``)."""
    from ple_tools.demo import disk_read_bytes

    after = table.stats() if table else {}
    delta = {key: after[key] - before[key] for key in after if isinstance(after[key], int)}
    return {"read_bytes": disk_read_bytes() - read0, "pages": delta.get("unique_pages"),
            "major_faults": delta.get("major_faults"),
            "row_cache_hits": delta.get("row_cache_hits"),
            "prefetch_hits": delta.get("prefetch_hits"), "direct_reads": delta.get("direct_reads"),
            "io_backend": table.io_backend if table else None}


def run_arm(spec: dict, layer, write_line) -> dict:
    """Runs the prompt through ``layer``, chunk by chunk; writes a line per
    chunk; returns the arm's record."""
    import numpy as np
    import torch

    from ple_tools.demo import disk_read_bytes

    table = layer.table
    tokens = torch.from_numpy(np.load(spec["tokens_path"]))
    compute = BusyCompute(spec["compute_ms"], spec["device"])
    chunk, ctx = spec["chunk"], layer.hashing.context_size
    device = torch.device(spec["device"])
    digest = hashlib.sha256()
    forward_s = compute_s = 0.0
    before, read0 = table.stats(), disk_read_bytes()
    start = time.perf_counter()
    if looks_ahead(spec["arm"]):
        layer.lookahead(layer.row_ids(tokens), chunk, max_bytes=spec["lookahead_mib"] * MiB)
    try:
        for index, first in enumerate(range(0, len(tokens), chunk)):
            ids = tokens[first:first + chunk]
            context = tokens[first - ctx:first].reshape(1, ctx) if first >= ctx else None
            t0, m0 = time.perf_counter(), time.monotonic()
            rows = layer(ids.to(device), context=None if context is None else context.to(device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            t1, m1 = time.perf_counter(), time.monotonic()
            compute.run()
            t2, m2 = time.perf_counter(), time.monotonic()
            forward_s, compute_s = forward_s + t1 - t0, compute_s + t2 - t1
            digest.update(rows.cpu().view(torch.int16).numpy().tobytes())  # untimed
            write_line({"chunk": index, "forward_s": t1 - t0, "compute_s": t2 - t1,
                        "reads": reads_record(table, before, read0), "t_start": m0,
                        "t_forward_end": m1, "t_end": m2})
    finally:
        if looks_ahead(spec["arm"]):
            layer.end_lookahead()
    total = time.perf_counter() - start
    return {"arm": spec["arm"], "seconds": total, "forward_s": forward_s, "compute_s": compute_s,
            **reads_record(table, before, read0), "sha256": digest.hexdigest(), "output": "rows"}


def child_main(spec_json: str) -> None:
    """One arm in this child: opens the table, enters the cgroup (if any),
    touches the ballast, runs the arm, writes its lines to the parent's file."""
    import numpy as np
    import torch

    import ple
    from ple.layers import NGramEmbedding
    from ple_tools.arm_child import write_line
    from ple_tools.cgroup import MemoryCgroup
    from ple_tools.make_table import PREFIX
    from ple_tools.table_layout import PAGE

    spec = json.loads(spec_json)
    through_model = spec["model_layers"] and split_arm(spec["arm"])[0] != READS
    # Every warm-up before the arm's table is opened: it reads nothing of it.
    warm_start = time.perf_counter()
    if through_model:
        from ple_tools.table_layout import Layout

        if spec["arm"] == COMPUTE:
            model = model_of(spec, None)
            warm_up(model, spec)  # its own table, in device memory
        else:
            warm_up_on_own_table(spec)
            model = model_of(spec, Layout.open(Path(spec["table"]), PREFIX).paths)
    else:
        warm_up_layer(spec)
        table = ple.Table.from_safetensors(spec["table"], PREFIX, arm_config(spec["arm"]))
        layer = NGramEmbedding(table, hashing_of(spec["ngram_base"]), dtype=torch.bfloat16)
    warm_up_s = time.perf_counter() - warm_start
    group = None
    if spec["cgroup"]:
        group = MemoryCgroup.attach(spec["cgroup"], spec["cgroup_version"], spec["limit"])
        group.enter()
        ballast = mmap.mmap(-1, max(spec["ballast"], 1),
                            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        np.frombuffer(ballast, dtype=np.uint8)[::PAGE] = 1
    if through_model:
        record = run_model_arm(spec, model, lambda line: write_line(spec, line))
    else:
        with table:
            record = run_arm(spec, layer, lambda line: write_line(spec, line))
    record["warm_up_s"] = warm_up_s
    if group is not None:
        record["cgroup"] = {"limit_bytes": group.limit, "ballast_bytes": spec["ballast"],
                            "peak": group.peak(), "oom_kills": group.oom_kills(),
                            "memory_stall_s": group.memory_stall_s()}
    write_line(spec, {"result": record})


def run_arm_child(args, arm: str, index: int, paths, tokens_path: Path, warm_table: Path) -> dict:
    """Drops the table's pages, runs `arm` in its child (in a cgroup of its
    own under --memory-limit) within --deadline; returns its record: the
    result, or the error or timeout with the chunks done; with
    --thread-profile, its threads' CPU by phase."""
    from ple_tools.arm_child import run_child
    from ple_tools.cgroup import MemoryCgroup
    from ple_tools.gather_arms import cached_bytes, drop_files
    from ple_tools.thread_profile import ThreadSampler, attribute

    group = None
    if args.memory_limit is not None:
        group = MemoryCgroup(f"ple-bench-{os.getpid()}-{index}", args.memory_limit + cache_mib(arm))
    try:
        drop_files(paths)  # this process maps nothing of the table
        cached_before = cached_bytes(paths)  # all of it on a filesystem that cannot drop
        spec = {"arm": arm, "table": str(args.table), "tokens_path": str(tokens_path),
                "ngram_base": args.ngram_base, "chunk": args.chunk,
                "compute_ms": args.compute_ms, "device": args.device,
                "lookahead_mib": args.lookahead_mib, "shards": args.shards,
                "model_layers": args.model_layers, "model_hidden": args.model_hidden,
                "model_experts": args.model_experts,
                "cgroup": str(group.path) if group else None,
                "cgroup_version": group.version if group else None,
                "limit": group.limit if group else None, "ballast": args.ballast * MiB,
                "warm_table": str(warm_table), "thread_profile": args.thread_profile}
        sampler = ThreadSampler() if args.thread_profile else None
        run = run_child("ple_tools.bench_prefill", spec, args.deadline, sampler)
        # The table's bytes that the arm brought into the page cache: its reads
        # of the table through it, whatever else the process read.
        table_cached = {"table_cached_bytes": max(0, cached_bytes(paths) - cached_before)}
        chunks = [line for line in run.lines if "chunk" in line]
        result = next((line["result"] for line in run.lines if "result" in line), None)
        if result is not None and run.code == 0:
            result["per_chunk_s"] = chunk_seconds(chunks)
            if sampler is not None:
                result["thread_profile"] = attribute(sampler, chunk_phases(chunks))
            return {**result, **table_cached}
        if run.timed_out:
            return {**timed_out_record(arm, args.deadline, chunks), **table_cached}
        kills = group.oom_kills() if group else 0
        return {"arm": arm, "error": f"the child exited with {run.code}"
                + (f" ({kills} OOM kill(s) in its cgroup)" if kills else ""),
                "chunks_done": len(chunks), **table_cached}
    finally:
        if group is not None:
            group.remove()


# The phases of a chunk in a thread profile: through a model, the main
# thread inside ple's layers and the rest of the chunk; the layer alone, its
# forward (the reads) and the compute after it.
MODEL_PHASES = ("in_ple", "model")
LAYER_PHASES = ("reads", "compute")


def chunk_phases(chunks: list[dict]) -> list[tuple[float, float, str]]:
    """The phases of the chunks' lines (time.monotonic() intervals)."""
    phases = []
    for c in chunks:
        if "t_forward_end" in c:
            phases += [(c["t_start"], c["t_forward_end"], LAYER_PHASES[0]),
                       (c["t_forward_end"], c["t_end"], LAYER_PHASES[1])]
            continue
        start = c["t_start"]
        for begin, end in c.get("in_ple", []):
            end = c["t_end"] if end is None else end
            phases += [(start, begin, MODEL_PHASES[1]), (begin, end, MODEL_PHASES[0])]
            start = end
        phases.append((start, c["t_end"], MODEL_PHASES[1]))
    return [phase for phase in phases if phase[1] > phase[0]]


def thread_profile_lines(record: dict) -> list[str]:
    from ple_tools.thread_profile import profile_lines

    profile = record["thread_profile"]
    names = list(LAYER_PHASES if LAYER_PHASES[0] in profile["samples"] else MODEL_PHASES)
    return [f"{record['arm']}: its threads' CPU while its chunks ran "
            + ("(in_ple: the main thread inside ple's layers; model: the rest of a chunk)"
               if names == list(MODEL_PHASES) else "(reads: the layer's forwards; compute: "
               "the compute stand-in after each)"),
            *profile_lines(profile, names)]


def chunk_seconds(chunks: list[dict]) -> list[float]:
    """Each chunk's time (its line's forward and compute)."""
    return [c["forward_s"] + c["compute_s"] for c in chunks]


def timed_out_record(arm: str, deadline_s: float, chunks: list[dict]) -> dict:
    """An arm killed at its deadline: the chunks it finished (their lines),
    their times, and what it had read by the last of them."""
    per_chunk = chunk_seconds(chunks)
    return {"arm": arm, "timed_out": True, "deadline_s": deadline_s, "chunks_done": len(chunks),
            "seconds_done": sum(per_chunk), "per_chunk_s": per_chunk,
            "reads_done": chunks[-1]["reads"] if chunks else None}


def arm_line(r: dict, chunks: int) -> str:
    if r.get("timed_out"):
        done = r["reads_done"]
        hits = None if done is None else done["prefetch_hits"]
        reads = "" if done is None else (
            f"; by then {done['read_bytes'] / MiB:.1f} MiB read"
            + ("" if hits is None else f", {hits:,} prefetch hits"))
        return (f"{r['arm']:<18} TIMED OUT after {r['deadline_s']:.0f} s "
                f"({r['chunks_done']} of {chunks} chunks, {r['seconds_done']:.1f} s{reads})")
    if "error" in r:
        return f"{r['arm']:<18} FAILED: {r['error']} ({r['chunks_done']} chunks done)"
    per = sorted(r["per_chunk_s"]) or [0.0]

    def count(key: str, width: int) -> str:
        return f"{'-':>{width}}" if r[key] is None else f"{r[key]:>{width},}"

    first = r["per_chunk_s"][0] if r["per_chunk_s"] else 0.0
    return (f"{r['arm']:<18} {r['seconds']:>8.2f} {r['forward_s']:>8.2f} {r['compute_s']:>8.2f} "
            f"{per[len(per) // 2] * 1e3:>9.1f} {first * 1e3:>9.1f} {per[-1] * 1e3:>9.1f} "
            f"{count('pages', 10)} "
            f"{r['read_bytes'] / MiB:>9.1f} {count('major_faults', 8)} "
            f"{count('row_cache_hits', 10)} {count('prefetch_hits', 6)}  "
            f"{r['sha256'][:16]} {r['output']}")


HEADER = (f"{'arm':<18} {'total s':>8} {'reads s':>8} {'compute':>8} {'chunk ms':>9} "
          f"{'1st ms':>9} {'max ms':>9} {'pages':>10} {'read MiB':>9} {'maj.flt':>8} "
          f"{'cache hits':>10} "
          f"{'pf.hit':>6}  sha256")


def goal_check(results: list[dict], through_model: bool, reader: str = WINDOW) -> dict | None:
    """Compute alone, reads alone, no lookahead (the reader's arm, where it
    ran) and lookahead over ``reader``, and the goal ratios; None unless
    the arms they need finished.  Through a model compute alone and reads
    alone are their own arms' (``reads`` or ``reads-<reader>``); otherwise
    the reader's arm's compute and forward times.  A reader other than the
    window is also compared with lookahead over the window."""
    by_arm = {r["arm"]: r for r in results if "sha256" in r}
    plain, ahead = by_arm.get(reader), by_arm.get(arm_name(LOOKAHEAD, reader))
    compute, reads = ((by_arm.get(COMPUTE), by_arm.get(arm_name(READS, reader))) if through_model
                      else (plain, plain))
    if None in (ahead, compute, reads):
        return None
    check = goal_ratios(compute["seconds" if through_model else "compute_s"], reads["forward_s"],
                        plain and plain["seconds"], ahead["seconds"])
    window_ahead = by_arm.get(LOOKAHEAD)
    if reader != WINDOW and window_ahead is not None:
        check.update(against_window_lookahead(ahead["seconds"], window_ahead["seconds"],
                                              ahead["read_bytes"], window_ahead["read_bytes"]))
    if through_model:  # a finished arm has a time for every chunk
        return with_overlap_bound(check, compute["per_chunk_s"], reads["per_chunk_s"])
    return check


def against_window_lookahead(seconds: float, window_seconds: float, read_bytes: int | None,
                             window_read_bytes: int | None) -> dict:
    """Lookahead over another reader against lookahead over the window: the
    time, and the bytes read where both are known."""
    against = {"window_lookahead_s": window_seconds,
               "lookahead_over_window_lookahead": seconds / window_seconds}
    if read_bytes is not None and window_read_bytes:
        against["read_bytes_over_window_lookahead"] = read_bytes / window_read_bytes
    return against


def with_overlap_bound(check: dict, compute_chunks: list[float], reads_chunks: list[float]) -> dict:
    """``check`` (goal_ratios') with the overlap bound of these chunks, and
    no lookahead (where it ran) and lookahead over it."""
    bound = overlap_bound(compute_chunks, reads_chunks)
    check = {**check, "overlap_bound_s": bound, "lookahead_over_bound": check["lookahead_s"] / bound}
    if check["no_lookahead_s"] is not None:
        check["bound_over_no_lookahead"] = bound / check["no_lookahead_s"]
    return check


def overlap_bound(compute_chunks: list[float], reads_chunks: list[float]) -> float:
    """The least time the chunks can take with their reads overlapped: the
    reads back to back from the start, however far ahead, and each chunk's
    compute once its reads and the chunk before are done (each chunk's
    compute alone and reads alone, in prompt order)."""
    read = done = 0.0
    for compute, reads in zip(compute_chunks, reads_chunks):
        read += reads
        done = max(done, read) + compute
    return done


def partial_goal_check(results: list[dict], reader: str = WINDOW) -> dict | None:
    """Through a model, where an arm it needs timed out: goal_check's
    ratios and the overlap bound over the first chunks that the compute,
    reads and lookahead arms of ``reader`` all finished (and the reader's
    own arm and, for another reader, lookahead over the window, where they
    ran), with their count; None where one of the three did not run or
    finished no chunk."""
    by_arm = {r["arm"]: r for r in results if r.get("per_chunk_s")}
    needed = [by_arm.get(arm) for arm in (COMPUTE, arm_name(READS, reader),
                                          arm_name(LOOKAHEAD, reader))]
    if None in needed:
        return None
    plain = by_arm.get(reader)
    window_ahead = by_arm.get(LOOKAHEAD) if reader != WINDOW else None
    chunks = min(len(r["per_chunk_s"]) for r in [*needed, plain, window_ahead] if r is not None)
    compute, reads, ahead = (sum(r["per_chunk_s"][:chunks]) for r in needed)
    check = goal_ratios(compute, reads, plain and sum(plain["per_chunk_s"][:chunks]), ahead)
    if window_ahead is not None:
        check.update(against_window_lookahead(ahead, sum(window_ahead["per_chunk_s"][:chunks]),
                                              None, None))
    return {"chunks": chunks, **with_overlap_bound(check, needed[0]["per_chunk_s"][:chunks],
                                                   needed[1]["per_chunk_s"][:chunks])}


def goal_ratios(compute: float, reads: float, no_lookahead: float | None, lookahead: float) -> dict:
    check = {"compute_alone_s": compute, "reads_alone_s": reads, "no_lookahead_s": no_lookahead,
             "lookahead_s": lookahead, "lookahead_over_max": lookahead / max(compute, reads)}
    if no_lookahead is not None:
        check["lookahead_over_no_lookahead"] = lookahead / no_lookahead
    return check


# The goals of lookahead over the window, and over another reader (direct
# I/O with a row cache, at the full size through a model).
WINDOW_GOALS = {"lookahead_over_no_lookahead": 0.6, "lookahead_over_max": 1.15}
READER_GOALS = {"lookahead_over_max": 1.05, "lookahead_over_window_lookahead": 0.75,
                "read_bytes_over_window_lookahead": 0.25}


def goal_line(check: dict, reader: str = WINDOW) -> str:
    goals = WINDOW_GOALS if reader == WINDOW else READER_GOALS

    def ratio(key: str, what: str) -> str:
        goal = f" (goal <= {goals[key]:g})" if key in goals else ""
        return f", {what} {check[key]:.2f}x{goal}" if key in check else ""

    no_lookahead = check["no_lookahead_s"]
    return (f"{arm_name(LOOKAHEAD, reader)}: compute alone {check['compute_alone_s']:.2f} s, "
            f"reads alone {check['reads_alone_s']:.2f} s, "
            + ("" if no_lookahead is None else f"no lookahead {no_lookahead:.2f} s, ")
            + f"lookahead {check['lookahead_s']:.2f} s"
            + ratio("lookahead_over_no_lookahead", "lookahead / no lookahead")
            + ratio("lookahead_over_max", "lookahead / max(compute, reads)")
            + ratio("lookahead_over_window_lookahead", "lookahead / lookahead over the window")
            + ratio("read_bytes_over_window_lookahead", "bytes read / lookahead over the window's")
            + ("" if "overlap_bound_s" not in check else
               f"; no overlap of these chunks takes less than {check['overlap_bound_s']:.2f} s"
               + ("" if "bound_over_no_lookahead" not in check else
                  f" ({check['bound_over_no_lookahead']:.2f}x no lookahead)")
               + f", lookahead took {check['lookahead_over_bound']:.2f}x of that"))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path,
                        help="the table's directory (ple_tools.make_table: reused if it holds "
                        "this table, refused if it holds files ple did not write; default "
                        "data/bench_prefill, --quick data/bench_prefill_quick)")
    parser.add_argument("--ngram-base", type=positive_int,
                        help="the hashing's ngram_vocab_size_base: the table's size (default "
                        "20000000, Flash-Next's: 320,001,536 rows; --quick 16384)")
    parser.add_argument("--shards", type=positive_int, help="table shards (default 128; --quick 8)")
    parser.add_argument("--files", type=positive_int, help="table files (default 32; --quick 4)")
    parser.add_argument("--tokens-count", type=positive_int,
                        help="prompt tokens: the first N of the text (default 184134; --quick 8192)")
    parser.add_argument("--chunk", type=positive_int, default=2048,
                        help="tokens a chunk (default 2048)")
    parser.add_argument("--text", action=InputFile, help="a UTF-8 text file to tokenize "
                        "(default: this Python's documentation)")
    parser.add_argument("--tokens", action=InputFile,
                        help="a .npy of token ids to use instead of tokenizing a text")
    parser.add_argument("--ranks", action=InputFile, help="GPT-2's gpt2.tiktoken (default "
                        f"{RANKS_CACHE}, downloaded there when missing)")
    parser.add_argument("--save-text", action=OutputFile, metavar="PATH",
                        help="write the text used")
    parser.add_argument("--save-tokens", action=OutputFile, metavar="PATH",
                        help="write the prompt's tokens (.npy)")
    parser.add_argument("--arms", help="arms to run, comma separated (default: window, all, "
                        "direct, direct-cache:MiB per --caches, lookahead)")
    parser.add_argument("--caches", type=row_cache_mib_list,
                        help="MiB of the direct-cache arms, comma separated "
                        "(default 512; --quick 16)")
    parser.add_argument("--lookahead-mib", type=lookahead_mib, default=64,
                        help="the lookahead arm's bound on rows read ahead (default 64)")
    parser.add_argument("--compute-ms", type=milliseconds, default=0.0, metavar="N",
                        help="busy compute after each chunk, ms (default 0: none)")
    parser.add_argument("--model-layers", type=non_negative_int, default=0, metavar="N",
                        help="run the arms through a Qwen4Exp-shaped model of N (3 or more) "
                        "decoder layers, random weights (default 0: the layer alone)")
    parser.add_argument("--model-hidden", type=positive_int, default=2048,
                        help="the model's hidden size (default 2048, transformers' default; "
                        "its heads and MLPs in proportion)")
    parser.add_argument("--model-experts", type=positive_int, default=64,
                        help="the model's experts a layer (default 64)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="where the layer's output and the compute go (default cuda when "
                        "available)")
    parser.add_argument("--memory-limit", type=positive_int, metavar="MiB",
                        help="each arm's child in a memory cgroup of this memory.high (plus "
                        "the row cache of a direct-cache arm; needs root or a delegated cgroup)")
    parser.add_argument("--ballast", type=non_negative_int, default=0, metavar="MiB",
                        help="touched anonymous memory each child holds in its cgroup")
    parser.add_argument("--deadline", type=seconds, metavar="S",
                        help="an arm still running after S seconds is killed and reported as "
                        "timed out (default 300; --quick 120)")
    parser.add_argument("--thread-profile", action="store_true",
                        help="sample each arm's threads every 10 ms (ple_tools.thread_profile) "
                        "and report their CPU by phase of the chunks")
    add_json_option(parser)
    parser.add_argument("--quick", action="store_true", help="a small run for CI (see below)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parse_with_defaults(parser, argv, DEFAULTS, QUICK)
    if not args.child:
        refuse_run(parser, args)
    return args


# What a prompt token takes in the parent: its id, its 16 row ids, their pages.
TOKEN_BYTES = 256


def known_arm(arm: str) -> bool:
    """Whether ``arm`` names an arm (arm_config's, without importing ple)."""
    _, reader = split_arm(arm)
    if reader is None:
        return True
    kind, colon, mib = reader.partition(":")
    if kind == "direct-cache":
        return mib.isdigit() and len(mib) < 20 and int(mib) <= MAX_ROW_CACHE_MIB
    return not colon and reader in (WINDOW, "all", "direct")


def refuse_model(parser: argparse.ArgumentParser, args: argparse.Namespace, device: str) -> None:
    """--model-layers' checks: a transformers with Qwen4Exp, a config it
    takes, and the model's bfloat16 weights within the device's memory."""
    import torch

    try:
        import transformers
    except ImportError:
        parser.error("argument --model-layers: the model is transformers' Qwen4Exp, and "
                     "transformers is not installed (pip install --no-build-isolation "
                     "'.[transformers]')")
    try:
        from transformers import Qwen4ExpForCausalLM
    except ImportError:
        parser.error(f"argument --model-layers: transformers {transformers.__version__} has no "
                     "Qwen4Exp")
    from ple_tools import prefill_model

    try:  # the compute arm's model: the others' table is served, not held
        config = prefill_model.flash_next_config(
            layers=args.model_layers, experts=args.model_experts, hidden=args.model_hidden,
            hashing=FLASH_NEXT, base=1000, shards=args.shards)
    except Exception as error:  # transformers' config checks raise several kinds
        parser.error(f"argument --model-hidden: transformers' Qwen4ExpTextConfig refuses "
                     f"{args.model_hidden} wide, {args.model_experts} experts: {error}")
    with torch.device("meta"):
        weights = 2 * sum(p.numel() for p in Qwen4ExpForCausalLM(config).parameters())
    what = (f"a model of {args.model_layers} layers, {args.model_hidden:,} wide, "
            f"{args.model_experts:,} experts (its bfloat16 weights)")
    if device != "cuda":
        refuse_over_memory(parser, "--model-hidden", weights, what)
    elif weights > torch.cuda.get_device_properties(0).total_memory:
        parser.error(f"argument --model-hidden: {what} takes {size(weights)}, more than the GPU's "
                     f"{size(torch.cuda.get_device_properties(0).total_memory)}")


def refuse_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks of the arguments together, before anything is written:
    the arms, the model, the device, the memory and the table."""
    arms = default_arms(args)
    unknown = [arm for arm in arms if not known_arm(arm)]
    if unknown:
        parser.error(f"argument --arms: unknown arm {unknown[0]!r}: arms are window, all, direct, "
                     "direct-cache:MiB, lookahead and lookahead-<arm>, and with --model-layers "
                     "compute, reads and reads-<arm>")
    if args.model_layers and args.model_layers < 3:
        parser.error("argument --model-layers: 3 or more (the PLE layer is decoder layer 2, and a "
                     "full-attention layer must follow)")
    if not args.model_layers and COMPUTE in arms:
        parser.error("argument --arms: the compute arm needs --model-layers")
    refuse_over_memory(parser, "--tokens-count", args.tokens_count * TOKEN_BYTES,
                       f"a prompt of {args.tokens_count:,} tokens")
    largest_cache = max(map(cache_mib, arms), default=0)
    refuse_over_memory(parser, "--caches", largest_cache * MiB,
                       f"a row cache of {largest_cache:,} MiB")
    refuse_directory(parser, args.table, "--table")
    import torch  # the arguments are good so far

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: cuda, and torch {torch.__version__} sees no CUDA device")
    if args.model_layers:
        refuse_model(parser, args, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    refuse_table(parser, args.table, rows=hashing_of(args.ngram_base).padded_rows(PAD_TO),
                 row_bytes=160, shards=args.shards, files=args.files,
                 options={"directory": "--table", "size": "--ngram-base", "shards": "--shards",
                          "files": "--files"})


def default_arms(args) -> list[str]:
    if args.arms:
        return [a.strip() for a in args.arms.split(",") if a.strip()]
    caches = [f"direct-cache:{int(m)}" for m in args.caches.split(",") if m.strip()]
    if args.model_layers:
        return ([COMPUTE, READS] + [arm_name(READS, c) for c in caches] + [WINDOW, LOOKAHEAD]
                + [arm_name(LOOKAHEAD, c) for c in caches])
    return [WINDOW, "all", "direct", *caches, LOOKAHEAD] + [arm_name(LOOKAHEAD, c) for c in caches]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    return run_recorded(args, "bench_prefill", argv, lambda: run(args))


def run(args) -> tuple[int, dict | None]:
    import numpy as np
    import torch

    from ple_tools.cgroup import CgroupError, MemoryCgroup
    from ple_tools.make_table import PREFIX, ensure_table
    from ple_tools.table_layout import Layout

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    arms = default_arms(args)
    if any(map(looks_ahead, arms)) and not lookahead_available():
        print("lookahead: not available (this ple's NGramEmbedding has no lookahead()); "
              "its arms are left out", file=sys.stderr)
        arms = [arm for arm in arms if not looks_ahead(arm)]
    if args.memory_limit is not None:
        try:
            MemoryCgroup(f"ple-bench-{os.getpid()}-probe", args.memory_limit).remove()
        except CgroupError as error:
            print(f"error: --memory-limit needs a memory cgroup that this tool creates, and it "
                  f"cannot: {error}", file=sys.stderr)
            return 2, None

    tokens, source = prompt_tokens(args)
    hashing = hashing_of(args.ngram_base)
    rows = hashing.padded_rows(PAD_TO)
    start = time.perf_counter()
    ensure_table(args.table, rows=rows, row_bytes=160, shards=args.shards, files=args.files)
    table_s = time.perf_counter() - start
    layout = Layout.open(args.table, PREFIX)
    row_ids = hashing.row_ids(torch.from_numpy(tokens)).numpy().ravel()
    prompt_pages = len(layout.pages(row_ids))
    chunks = -(-len(tokens) // args.chunk)

    setup = (f"{len(tokens):,} tokens of {source.get('text', source.get('tokens_file'))}"
             f"{' (' + source['tokenizer'] + ')' if 'tokenizer' in source else ''}, "
             f"{chunks} chunks of {args.chunk}; Flash-Next hashing (base {args.ngram_base:,}): "
             f"{len(row_ids):,} row reads on {prompt_pages:,} distinct pages; table "
             f"{layout.num_rows:,} rows of 160 B in {len(layout.shard_rows)} shards over "
             f"{len(layout.paths)} files ({layout.num_rows * 160 / 1e9:.1f} GB, ready in "
             f"{table_s:.0f} s); device {args.device}; "
             + (f"through a Qwen4Exp-shaped model ({args.model_layers} layers, hidden "
                f"{args.model_hidden}, {args.model_experts} experts, bf16, random weights): "
                f"time to the first token; " if args.model_layers else
                f"compute {args.compute_ms:g} ms a chunk; ")
             + f"pages dropped before each arm; deadline {args.deadline:.0f} s an arm")
    if args.memory_limit is not None:
        setup += (f"; each arm in a memory cgroup of memory.high {args.memory_limit} MiB (+ its "
                  f"row cache) with {args.ballast} MiB of touched ballast")
    print(setup, file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory(prefix="ple-prefill-") as tmp:
        tokens_path = Path(tmp) / "tokens.npy"
        np.save(tokens_path, tokens)
        # The small table every arm warms up on (its own files: the warm-up
        # reads nothing the arm will read).
        warm_table = Path(tmp) / "warm_table"
        ensure_table(warm_table, rows=hashing_of(OWN_TABLE_BASE).padded_rows(PAD_TO),
                     row_bytes=160, shards=args.shards, files=min(args.files, args.shards))
        print(HEADER, file=sys.stderr)
        for index, arm in enumerate(arms):
            results.append(run_arm_child(args, arm, index, layout.paths, tokens_path, warm_table))
            print(arm_line(results[-1], chunks), file=sys.stderr, flush=True)
            if "thread_profile" in results[-1]:
                print("\n".join(thread_profile_lines(results[-1])), file=sys.stderr, flush=True)

    print(setup)
    print(HEADER)
    print("-" * len(HEADER))
    for r in results:
        print(arm_line(r, chunks))
    for r in results:
        if "thread_profile" in r:
            print("\n".join(thread_profile_lines(r)))
    # The compute arm's own table gives other outputs: it is compared with no arm.
    outputs = {}
    for r in results:
        if "sha256" in r and r["arm"] != COMPUTE:
            outputs.setdefault(r["output"], set()).add(r["sha256"])
    differ = [output for output, digests in outputs.items() if len(digests) > 1]
    failed = [r["arm"] for r in results if "error" in r]
    timed_out = [r["arm"] for r in results if r.get("timed_out")]
    print()
    for output, digests in outputs.items():
        if len(digests) == 1:
            print(f"every finished arm gave the same {output} (sha256 {next(iter(digests))})")
        else:
            print(f"FAIL: the arms gave different {output}s")
    if timed_out:
        print(f"timed out (killed at {args.deadline:.0f} s): {', '.join(timed_out)}")
    checks, partials = {}, {}
    for reader in [split_arm(arm)[1] for arm in arms if looks_ahead(arm)]:
        name = arm_name(LOOKAHEAD, reader)
        checks[name] = (goal_check(results, bool(args.model_layers), reader)
                        if args.compute_ms > 0 or args.model_layers else None)
        partials[name] = (partial_goal_check(results, reader)
                          if args.model_layers and not checks[name] else None)
        if checks[name]:
            print(goal_line(checks[name], reader))
        if partials[name]:
            print(f"not the goals (an arm timed out), over the first {partials[name]['chunks']} "
                  f"chunks every arm finished: {goal_line(partials[name], reader)}")
    document = {"setup": setup, "source": source, "prompt_pages": prompt_pages,
                "row_reads": len(row_ids), "chunks": chunks, "table_seconds": table_s,
                "table": {"num_rows": layout.num_rows, "shard_rows": layout.shard_rows,
                          "files": [str(p) for p in layout.paths]},
                "arms": results, "sha256_equal": not differ, "failed_arms": failed,
                "timed_out_arms": timed_out, "goal_checks": checks,
                "partial_goal_checks": partials}
    return (1 if failed or differ else 0), document


if __name__ == "__main__":
    sys.exit(main())
