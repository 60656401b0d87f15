"""ple.layers.parallel: the row ranges of the ranks, their shares summing to
the whole bit for bit, and two processes on gloo giving the embedding of one.

The two-process test runs this file as a script, once per rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from helpers import assert_same_bits, write_gguf
from ple.layers import NGramEmbedding, NGramHashing, PackedGGUFEmbedding
from ple.layers.parallel import RowSplit, row_range

HASHING = dict(vocab_size=1001, eos_id=7, ple_layer_index=2, base_size=100)
VOCAB_ROWS, COLS = 1001, 32  # 1001 = 7 * 11 * 13: no small world size divides it
WORKER_TIMEOUT_S = 120


# ---- the row ranges ------------------------------------------------------------------


@pytest.mark.parametrize("num_rows, world_size, ranges", [
    (12, 3, [(0, 4), (4, 8), (8, 12)]),
    (10, 3, [(0, 4), (4, 8), (8, 10)]),
    (9, 4, [(0, 3), (3, 6), (6, 9), (9, 9)]),
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),
    (1, 1, [(0, 1)]),
])
def test_row_ranges(num_rows, world_size, ranges):
    assert [row_range(num_rows, rank, world_size) for rank in range(world_size)] == ranges


def test_row_ranges_cover_every_row_once():
    for num_rows in range(1, 40):
        for world_size in range(1, 12):
            ranges = [row_range(num_rows, rank, world_size) for rank in range(world_size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == num_rows
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert all(start <= stop for start, stop in ranges)


@pytest.mark.parametrize("args, message", [
    ((10, 3, 3), r"rank must be in \[0, world_size\), got rank 3 of 3"),
    ((10, -1, 3), r"rank must be in \[0, world_size\), got rank -1 of 3"),
    ((10, 0, 0), r"rank must be in \[0, world_size\), got rank 0 of 0"),
    ((-1, 0, 1), r"num_rows must be >= 0, got -1"),
])
def test_bad_row_range_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        row_range(*args)


def test_a_table_of_no_rows_is_not_split():
    with pytest.raises(ValueError, match="a table of no rows cannot be split across ranks"):
        RowSplit(0, 0, 2)


# ---- the tables ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """An n-gram checkpoint (FP8 without NaN, some -0.0 bytes) and a GGUF file
    with a Q8_0 token embedding and a table of one row."""
    directory = tmp_path_factory.mktemp("tp")
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (NGramHashing(**HASHING).rows + 13, COLS), dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] ^= 1
    raw[:, 0] = 0x80
    save_file({"ngram_embedding.shard_0.weight": torch.from_numpy(raw).view(torch.float8_e4m3fn),
               "ngram_embedding.weight_scale": torch.tensor(0.25)},
              str(directory / "ngram.safetensors"))
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    write_gguf(directory / "model.gguf", {
        name: (gguf.quants.quantize(rng.uniform(-1, 1, (rows, COLS)).astype(np.float32), q8_0), q8_0)
        for name, rows in (("token_embd.weight", VOCAB_ROWS), ("one_row", 1))})
    return directory


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB_ROWS, (50,), generator=generator)
    tokens[:3] = torch.tensor([0, VOCAB_ROWS - 1, HASHING["eos_id"]])
    seq_ids = torch.arange(50) // 20
    context = torch.randint(0, VOCAB_ROWS, (3, 2), generator=generator)
    return tokens, seq_ids, context


def open_layers(directory: Path, process_group=None):
    return (NGramEmbedding.from_safetensors(directory, process_group=process_group, **HASHING),
            PackedGGUFEmbedding(directory / "model.gguf", process_group=process_group),
            PackedGGUFEmbedding(directory / "model.gguf", "one_row", process_group=process_group))


def embeddings(layers, inputs) -> list[torch.Tensor]:
    ngram, token, one_row = layers
    tokens = inputs[0]
    return [ngram(*inputs), token(tokens), one_row(torch.zeros_like(tokens))]


@pytest.mark.parametrize("num_rows_of", ["ngram", "token"])
@pytest.mark.parametrize("world_size", [2, 3, 2000])
def test_the_shares_of_every_rank_sum_to_the_rows_bit_for_bit(tables, num_rows_of, world_size):
    """The split's gather and mask for each rank in one process, summed as
    all_reduce sums them; 2000 ranks leave many with no rows."""
    ngram, token, _ = layers = open_layers(tables)
    layer = ngram if num_rows_of == "ngram" else token
    ids = ngram.row_ids(*batch(1)) if layer is ngram else batch(1)[0]
    whole = torch.ops.ple.disk_gather(ids, layer.table.handle, torch.bfloat16)
    total = None
    for rank in range(world_size):
        split = RowSplit(layer.table.num_rows, rank, world_size)
        gathered = split.ids_to_gather(ids)
        # A rank reads only its own rows; one with none reads the last row.
        low, high = (split.start, split.stop) if split.start < split.stop else (
            layer.table.num_rows - 1, layer.table.num_rows)
        assert ((gathered >= low) & (gathered < high)).all()
        rows = torch.ops.ple.disk_gather(gathered, layer.table.handle, torch.bfloat16)
        share = split.keep_own_rows(rows, ids)
        total = share if total is None else total + share
    assert_same_bits(total, whole)
    if layer is ngram:  # its column 0 is -0.0, which a +0.0 fill would sum to +0.0
        assert_same_bits(whole[..., 0], torch.full_like(whole[..., 0], -0.0))
    for opened in layers:
        opened.table.close()


# ---- two processes -------------------------------------------------------------------


def test_two_ranks_on_gloo_give_the_embedding_of_one_process(tables, tmp_path):
    inputs = [batch(2), batch(3)]
    torch.save(inputs, tmp_path / "inputs.pt")
    init_method = f"file://{tmp_path / 'store'}"
    workers = [subprocess.Popen([sys.executable, __file__, str(tables), str(tmp_path), init_method,
                                 str(rank), "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for rank in range(2)]
    logs = []
    try:
        for worker in workers:
            logs.append(worker.communicate(timeout=WORKER_TIMEOUT_S)[0])
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
    for rank, (worker, log) in enumerate(zip(workers, logs)):
        assert worker.returncode == 0, f"rank {rank} failed:\n{log}"

    layers = open_layers(tables)
    expected = [embeddings(layers, step) for step in inputs]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for got_step, expected_step in zip(got["outputs"], expected):
            for got_rows, expected_rows in zip(got_step, expected_step):
                assert_same_bits(got_rows, expected_rows)
        assert got["prefetch_hits"] == 1
        # Its own token rows came from its host tier, the others' ids (clamped
        # to an own row, then masked) too: nothing of the token table from disk.
        assert got["token_stats"]["host_tier_hits"] == inputs[1][0].numel()
        assert got["token_stats"]["rows"] == 0
        assert got["ranges"] == [row_range(layer.table.num_rows, rank, 2) for layer in layers]
    for layer in layers:
        layer.table.close()


def worker(directory: Path, out: Path, init_method: str, rank: int, world_size: int) -> None:
    """One rank: the layers split over the group, run on each step's inputs
    (the second step's n-gram rows prefetched, and its token rows from each
    rank's host tier of its own rows), saved for the test to compare."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    layers = open_layers(directory, dist.group.WORLD)
    inputs = torch.load(out / "inputs.pt")
    outputs = [embeddings(layers, inputs[0])]
    ngram, token = layers[0], layers[1]
    ngram.table.reset_stats()
    ngram.prefetch(*inputs[1])
    # Each rank keeps its own rows of the token table in the host tier.
    token.table.place(host_rows=token.split.stop - token.split.start, first_row=token.split.start)
    token.table.reset_stats()
    outputs.append(embeddings(layers, inputs[1]))
    torch.save({"outputs": outputs, "prefetch_hits": ngram.table.stats()["prefetch_hits"],
                "token_stats": token.table.stats(),
                "ranges": [(layer.split.start, layer.split.stop) for layer in layers]},
               out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
