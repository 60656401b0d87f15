"""The tiny model of tools/tiny_model.py: its tables, its layers, its prompt,
and each execution mode it runs in."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from ple.layers import NGramEmbedding, NGramHashing, PackedGGUFEmbedding
from ple_tools import written
from ple_tools.make_table import PREFIX, table_files, write_table
from ple_tools.tiny_model import MARKER, TOOL, WHAT

VOCAB_SIZE = 4096
HIDDEN = 256  # token embedding width: a multiple of Q8_0's 32-value blocks
EOS_ID = 2
BASE_SIZE = 2000  # 16 heads of about 2,000 rows: a 1 MiB n-gram table
NGRAM_COLS = 32  # FP8 values per n-gram row
REQUESTS = 2
CHUNK = 8  # tokens per request and step
STEPS = 4
DTYPE = torch.bfloat16

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # token_ids, seq_ids, context


class TinyModel(torch.nn.Module):
    def __init__(self, token_embedding: PackedGGUFEmbedding, ngram_embedding: NGramEmbedding):
        super().__init__()
        self.token_embedding = token_embedding
        self.ngram_embedding = ngram_embedding
        self.ngram_projection = torch.nn.Linear(ngram_embedding.embedding_dim,
                                                token_embedding.embedding_dim, bias=False,
                                                dtype=DTYPE)

    def forward(self, token_ids, seq_ids, context):
        ngrams = self.ngram_embedding(token_ids, seq_ids, context)
        # token + ngrams @ W.T as one addmm: Inductor turns `token + projection(ngrams)`
        # into this anyway, and it rounds once where the eager sum rounds twice, so
        # writing it out keeps every mode's output bit for bit equal.
        return torch.addmm(self.token_embedding(token_ids), ngrams, self.ngram_projection.weight.t())

    def prefetch(self, token_ids, seq_ids, context) -> None:
        self.token_embedding.prefetch(token_ids)
        self.ngram_embedding.prefetch(token_ids, seq_ids, context)


GGUF_FILE = "tiny.gguf"


def write_tables(out: Path) -> tuple[list[Path], Path]:
    """The n-gram table's files and the GGUF file, written into ``out``,
    which its marker (ple_tools.written) lists them in: raises
    ple_tools.written.ForeignFilesError, before writing or deleting
    anything, when ``out`` holds files the tool did not write."""
    layout = dict(rows=NGramHashing(vocab_size=VOCAB_SIZE, eos_id=EOS_ID, base_size=BASE_SIZE).rows,
                  row_bytes=NGRAM_COLS, shards=4, files=2)
    names = [*table_files(**layout), GGUF_FILE]
    marker = out / MARKER
    record = written.read_record(marker, TOOL)
    written.refuse_foreign(out, marker, record, WHAT)
    written.begin(out, marker, TOOL, record, names, what=WHAT)
    ngram_files = write_table(out, **layout)
    values = np.random.default_rng(0).normal(0, 0.02, (VOCAB_SIZE, HIDDEN)).astype(np.float32)
    gguf_path = out / GGUF_FILE
    writer = gguf.GGUFWriter(str(gguf_path), "tiny")
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    written.finish(marker, TOOL, names, what=WHAT)
    return ngram_files, gguf_path


def prompt_chunks() -> list[Batch]:
    """Chunked prefill of two requests: each step carries CHUNK tokens of each,
    with each request's last two tokens of the step before as context."""
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, VOCAB_SIZE, (REQUESTS, STEPS * CHUNK), generator=generator)
    prompts[torch.rand(prompts.shape, generator=generator) < 0.1] = EOS_ID
    seq_ids = torch.arange(REQUESTS).repeat_interleave(CHUNK)
    batches = []
    for step in range(STEPS):
        start = step * CHUNK
        context = (prompts[:, start - 2:start] if step else
                   torch.full((REQUESTS, 2), EOS_ID, dtype=torch.int64))
        batches.append((prompts[:, start:start + CHUNK].reshape(-1), seq_ids, context))
    return batches


def run_steps(model: TinyModel, step: Callable[[Batch], torch.Tensor], batches: list[Batch]
              ) -> list[torch.Tensor]:
    """Runs ``step`` on each batch and returns its outputs on the CPU.  Each
    batch's rows are prefetched once the step before has returned its output:
    a table holds one pending prefetch, and a gather still queued in a CUDA
    stream must have taken its own before the next one is made."""
    outputs = []
    model.prefetch(*batches[0])
    for index, batch in enumerate(batches):
        outputs.append(step(batch).cpu())
        if index + 1 < len(batches):
            model.prefetch(*batches[index + 1])
    return outputs


def captured(model: TinyModel, example: Batch) -> Callable[..., torch.Tensor]:
    """The model as a CUDA graph captured by hand: a call copies its inputs
    into the static ones and replays the graph."""
    static = [tensor.cuda() for tensor in example]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: Triton compiles, head tensors are made
        model(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(*static)

    def replay(*inputs: torch.Tensor) -> torch.Tensor:
        for destination, source in zip(static, inputs):
            destination.copy_(source)
        graph.replay()
        return static_out

    return replay


def counter_line(table) -> str:
    stats = table.stats()
    return ", ".join(f"{key} {stats[key]}" for key in (
        "calls", "rows", "prefetch_hits", "prefetch_misses", "device_tier_hits", "host_tier_hits"))


def run(out: Path | None, device: str | None) -> int:
    """Runs the model in every mode on ``device`` (None: CUDA when there is
    one), its tables written in ``out`` (None: a temporary directory)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with tempfile.TemporaryDirectory() as scratch:
        out = out or Path(scratch)
        ngram_files, gguf_path = write_tables(out)
        token_embedding = PackedGGUFEmbedding(gguf_path, dtype=DTYPE)
        ngram_embedding = NGramEmbedding.from_safetensors(
            ngram_files, tensor=PREFIX, vocab_size=VOCAB_SIZE, eos_id=EOS_ID, base_size=BASE_SIZE,
            dtype=DTYPE)
        torch.manual_seed(0)
        model = TinyModel(token_embedding, ngram_embedding).to(device)
        tables = {"token_embd": token_embedding.table, "ngram": ngram_embedding.table}
        for table in tables.values():
            eighth = table.num_rows // 8
            table.place(device_rows=eighth if device.type == "cuda" else 0, host_rows=eighth,
                        device=device if device.type == "cuda" else None)
        batches = prompt_chunks()

        # Each mode's model, made when its turn comes (a capture runs the model).
        modes = {"eager": lambda: model, "compiled": lambda: torch.compile(model, fullgraph=True)}
        if device.type == "cuda":
            modes["reduce-overhead"] = lambda: torch.compile(model, fullgraph=True,
                                                             mode="reduce-overhead")
            modes["cuda graph"] = lambda: captured(model, batches[0])
        print(f"tiny model on {device}: {model}")
        expected = None
        for mode, make in modes.items():
            run = make()

            def step(batch: Batch) -> torch.Tensor:
                return run(*(tensor.to(device) for tensor in batch))

            for table in tables.values():
                table.reset_stats()
            outputs = run_steps(model, step, batches)
            if expected is None:
                expected = outputs
            same = all(torch.equal(got, want) for got, want in zip(outputs, expected))
            print(f"{mode:>15}: {len(outputs)} steps, output {tuple(outputs[0].shape)}, "
                  f"{'equal to eager' if same else 'DIFFERS from eager'}")
            for name, table in tables.items():
                print(f"{'':>17}{name}: {counter_line(table)}")
            if not same:
                print(f"tiny_model: {mode} outputs differ from eager", file=sys.stderr)
                return 1
        for name, table in tables.items():
            print(f"{name} {table}: {table.stats()}")
        for table in tables.values():
            table.close()
    return 0
