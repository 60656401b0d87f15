"""ple.layers.parallel: the row ranges of the ranks, their shares summing to
the whole bit for bit, the rows a layer places in its tiers on each rank,
and two processes on gloo giving the embedding of one (eager, prefetched,
compiled, and from tiers of each rank's own rows).

The two-process test runs tensor_parallel_cases.py as a script, once per
rank; test_tensor_parallel_cuda.py runs it on GPUs."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_bits
from ple.layers.parallel import RowSplit, row_range, served_rows
from tensor_parallel_cases import batch, check_ranks, open_layers, run_two_ranks, write_tables

# Two ranks compile the layers on the CPU at once (inductor, each its own C++).
WORKER_TIMEOUT_S = 600


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
    return write_tables(tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("num_rows_of", ["ngram", "token"])
@pytest.mark.parametrize("world_size", [2, 3, 2000])
def test_the_shares_of_every_rank_sum_to_the_rows_bit_for_bit(tables, num_rows_of, world_size):
    """The split's gather and mask for each rank in one process, summed as
    all_reduce sums them; 2000 ranks leave many with no rows."""
    ngram, token, *_ = layers = open_layers(tables)
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


# ---- the rows a rank places in its tiers ----------------------------------------------


@pytest.mark.parametrize("rank, world_size, start, stop, served", [
    (0, 2, 0, 10, (0, 5)), (1, 2, 0, 10, (5, 10)),
    (0, 2, 3, 8, (3, 5)), (1, 2, 3, 8, (5, 8)),
    (1, 2, 0, 4, (4, 4)),  # the layer's rows all lie in rank 0's range
    (0, 2, 6, 10, (6, 6)),
    (3, 4, 0, 9, (9, 9)),  # a rank with no rows of the table
])
def test_served_rows_are_the_layers_rows_in_the_ranks_range(rank, world_size, start, stop, served):
    assert served_rows(RowSplit(10, rank, world_size), start, stop) == served
    assert served_rows(None, start, stop) == (start, stop)


def test_a_layer_places_its_tiers_from_its_first_served_row(tables):
    ngram, token, *_ = layers = open_layers(tables)
    token.split = RowSplit(token.num_embeddings, 1, 2)  # rank 1 of 2, without a process group
    assert token.served_rows == (501, 1001)
    token.place(host_rows=500)
    assert token.table.resident_range == (501, 1001)
    with pytest.raises(ValueError, match=r"device_rows \+ host_rows = 501 is more than the 500 "
                       r"rows \[501, 1001\) of table 'token_embd.weight' that this layer gathers"):
        token.place(host_rows=501)
    with pytest.raises(ValueError, match="host_rows must be a non-negative int, got -1"):
        token.place(host_rows=-1)
    token.place()
    assert token.table.tiers is None
    assert ngram.served_rows == (0, ngram.hashing.rows)  # not the 13 rows past the layer's
    ngram.place(host_rows=ngram.hashing.rows)
    assert ngram.table.resident_range == (0, ngram.hashing.rows)
    for layer in layers:
        layer.table.close()


# ---- two processes -------------------------------------------------------------------


def test_two_ranks_on_gloo_give_the_embedding_of_one_process(tables, tmp_path):
    run_two_ranks(tables, tmp_path, "gloo", "cpu", WORKER_TIMEOUT_S)
    check_ranks(tables, tmp_path, 2, "cpu", graph=False)
