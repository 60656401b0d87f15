"""table.prefetch: a gather started ahead on a background thread, taken by the
next gather of the same ids, byte-identical to a gather without it."""

import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple

ROWS, ROW_BYTES = 3000, 160


@pytest.fixture(scope="module")
def table_and_reference(tmp_path_factory):
    reference = np.random.default_rng(5).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)
    path = tmp_path_factory.mktemp("prefetch") / "t.safetensors"
    save_file({"t": torch.from_numpy(reference)}, str(path))
    with ple.Table.from_safetensors(path) as table:
        yield table, reference


def test_matching_ids_take_the_prefetched_rows(table_and_reference):
    table, reference = table_and_reference
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, ROWS, 2500))
    table.reset_stats()
    table.prefetch(ids)
    rows = torch.ops.ple.disk_gather_bytes(ids, table.handle)
    assert np.array_equal(rows.numpy(), reference[ids.numpy()])
    stats = table.stats()
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (1, 0)
    assert stats["calls"] == 1  # the prefetch's gather; the operator took its rows


def test_other_ids_are_gathered_and_counted_as_a_miss(table_and_reference):
    table, reference = table_and_reference
    ids = torch.arange(10)
    table.reset_stats()
    table.prefetch(ids + 1)
    rows = torch.ops.ple.disk_gather_bytes(ids, table.handle)
    assert np.array_equal(rows.numpy(), reference[ids.numpy()])
    assert table.stats()["prefetch_misses"] == 1
    # the pending prefetch is still there for its own ids
    rows = torch.ops.ple.disk_gather_bytes(ids + 1, table.handle)
    assert np.array_equal(rows.numpy(), reference[ids.numpy() + 1])
    assert table.stats()["prefetch_hits"] == 1


def test_a_prefetch_of_a_bad_id_leaves_the_error_to_the_gather(table_and_reference):
    table, _ = table_and_reference
    ids = torch.tensor([0, ROWS])
    table.prefetch(ids)
    with pytest.raises(IndexError, match=rf"row id {ROWS} at position 1 is out of range \[0, {ROWS}\)"):
        torch.ops.ple.disk_gather_bytes(ids, table.handle)


def test_prefetch_rejects_float_ids(table_and_reference):
    table, _ = table_and_reference
    with pytest.raises(TypeError, match="int32 or int64"):
        table.prefetch(torch.zeros(3))


def test_several_prefetches_wait_in_order_for_their_gathers(table_and_reference):
    """A server prefetches step n + 1 before its stream has reached step n's
    gather: both prefetches must still be there for their gathers."""
    table, reference = table_and_reference
    steps = [torch.from_numpy(np.random.default_rng(seed).integers(0, ROWS, 700)) for seed in range(3)]
    table.reset_stats()
    for ids in steps:
        table.prefetch(ids)
    for ids in steps:
        rows = torch.ops.ple.disk_gather_bytes(ids, table.handle)
        assert np.array_equal(rows.numpy(), reference[ids.numpy()])
    assert (table.stats()["prefetch_hits"], table.stats()["prefetch_misses"]) == (3, 0)


def test_many_small_prefetches_all_wait(table_and_reference):
    """Many layers sharing a table each prefetch a step's rows."""
    table, _ = table_and_reference
    steps = [torch.arange(layer, layer + 16) for layer in range(40)]
    table.reset_stats()
    for ids in steps:
        table.prefetch(ids)
    for ids in steps:
        torch.ops.ple.disk_gather_bytes(ids, table.handle)
    assert (table.stats()["prefetch_hits"], table.stats()["prefetch_misses"]) == (40, 0)


def test_prefetches_beyond_the_byte_cap_drop_the_oldest(table_and_reference):
    """Prefetches not taken hold at most 256 MiB of rows: three of 112 MB keep
    the newest two."""
    table, reference = table_and_reference
    rng = np.random.default_rng(9)
    steps = [torch.from_numpy(rng.integers(0, ROWS, 700_000)) for _ in range(3)]
    for ids in steps:
        table.prefetch(ids)
    table.reset_stats()
    outcomes = []
    for ids in steps:
        rows = torch.ops.ple.disk_gather_bytes(ids, table.handle)
        assert np.array_equal(rows.numpy(), reference[ids.numpy()])
        outcomes.append("hit" if table.stats()["prefetch_hits"] > outcomes.count("hit") else "miss")
    assert outcomes == ["miss", "hit", "hit"]  # the oldest was dropped
    stats = table.stats()
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (2, 1)


def test_int32_ids_take_a_prefetch_of_the_same_values(table_and_reference):
    table, reference = table_and_reference
    ids = torch.arange(100, 300, dtype=torch.int32)
    table.reset_stats()
    table.prefetch(ids)
    rows = table.gather_bytes(ids)
    assert np.array_equal(rows.numpy(), reference[ids.numpy()])
    assert (table.stats()["prefetch_hits"], table.stats()["prefetch_misses"]) == (1, 0)


def test_dropping_an_owners_prefetches_waits_for_one_pushed_out_while_read(tmp_path):
    """A prefetch that a newer one pushes past the byte cap while it is read
    is read on to its end: dropping its owner's prefetches waits for it, so
    none of its rows is held when the call returns."""
    row_bytes = 4 << 20
    reference = np.random.default_rng(11).integers(0, 256, (8, row_bytes), dtype=np.uint8)
    path = tmp_path / "t.safetensors"
    save_file({"t": torch.from_numpy(reference)}, str(path))
    with ple.Table.from_safetensors(path) as table:
        table.config = ple.GatherConfig(policy="none", threads=1)
        table.drop_page_cache()  # cold: the first prefetch is still read when the second comes
        table.prefetch(torch.arange(8), owner=1)
        time.sleep(0.02)  # the prefetch thread starts reading it
        table.prefetch(torch.arange(57) % 8, owner=2)  # 8 + 57 rows of 4 MiB: over 256 MiB
        if table.prefetched_bytes(1) == 0:
            pytest.skip("the first prefetch was not being read when the second pushed it out")
        table.drop_prefetches(1)
        assert table.prefetched_bytes(1) == 0
        table.drop_prefetches(2)
        ids = torch.tensor([7, 0, 3])
        assert np.array_equal(table.gather_bytes(ids).numpy(), reference[ids.numpy()])


def test_a_plan_advances_on_its_owners_gathers_alone(table_and_reference):
    """Table.plan_prefetches: the chunks are read one bound ahead; the
    owner's gather of the next chunk takes it and lets the next be read;
    gathers of other owners leave the plan; a plan replaced is not ended by
    the old one's end; a gather of the next chunk padded (another size) takes
    its rows and ends the plan."""
    table, reference = table_and_reference
    chunks = [torch.arange(k * 100, (k + 1) * 100) for k in range(4)]
    chunk_bytes = 100 * ROW_BYTES
    table.reset_stats()
    first = table.plan_prefetches(5, chunks, chunk_bytes)
    assert table.planning(5, first) and table.prefetched_bytes(5) == chunk_bytes
    for k, chunk in enumerate(chunks[:2]):
        rows = table.gather_bytes(chunk, owner=5)
        assert np.array_equal(rows.numpy(), reference[chunk.numpy()])
        assert table.prefetched_bytes(5) == chunk_bytes  # the next one, read ahead
        table.gather_bytes(torch.arange(5), owner=6)
        table.gather_bytes(torch.arange(5))
        assert table.planning(5, first), k
    assert table.stats()["prefetch_hits"] == 2
    second = table.plan_prefetches(5, chunks, chunk_bytes)
    table.end_plan(5, first)
    assert second != first and table.planning(5, second) and not table.planning(5, first)
    padded = torch.cat([chunks[0], torch.arange(7)])
    rows = table.gather_bytes(padded, owner=5)
    assert np.array_equal(rows.numpy(), reference[padded.numpy()])
    assert table.stats()["prefetch_hits"] == 3
    assert not table.planning(5) and table.prefetched_bytes() == 0


def test_a_plan_refuses_a_bound_the_queue_cannot_hold(table_and_reference):
    table, _ = table_and_reference
    for bad in (0, -1, (256 << 20) + 1, 1.5):
        with pytest.raises(ValueError, match=rf"^ple: a plan's bound is more than 0 and at most "
                                             rf"268435456 bytes \(what a table's prefetches "
                                             rf"hold\), not {bad}$"):
            table.plan_prefetches(5, [torch.arange(3)], bad)
    assert not table.planning(5) and table.prefetched_bytes() == 0
