"""Tiers and the row cache: every split of a table's rows among device, host
and disk, and the cache on or off, give the bytes of a disk-only gather, and
the counters say which tier served each row.

The CPU tests run everywhere (the host tier works without CUDA); the device
tier, the CUDA operator with tiers, graphs and compile need a GPU.  The
decoders reading rows from the tiers are tested under Triton's interpreter
in test_tier_rows_triton.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple
from helpers import write_byte_table

ROWS, ROW_BYTES = 2000, 160
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def reference():
    return np.random.default_rng(8).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)


@pytest.fixture
def table(tmp_path, reference):
    path = tmp_path / "t.safetensors"
    rows = torch.from_numpy(reference).view(torch.float8_e4m3fn)
    save_file({"emb.shard_0.weight": rows[:1200], "emb.shard_1.weight": rows[1200:],
               "emb.weight_scale": torch.tensor(0.25)}, str(path))
    with ple.Table.from_safetensors(path) as opened:
        yield opened


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (random FP8 bytes hold NaNs; the CPU and
    the CUDA decoders may give them different payloads)."""
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True)
    return True


def request_ids(seed: int, n: int = 3000) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, ROWS, n)
    ids[:4] = [0, ROWS - 1, 0, 999]  # both ends, a duplicate
    return torch.from_numpy(ids)


@pytest.mark.parametrize("host_rows", [0, 1, 999, 1000, ROWS])
def test_host_tier_gives_the_disk_bytes_and_counts_each_tier(table, reference, host_rows):
    table.place(host_rows=host_rows)
    table.reset_stats()
    ids = request_ids(host_rows)
    rows = table.gather_bytes(ids)
    assert np.array_equal(rows.numpy(), reference[ids.numpy()])
    stats = table.stats()
    on_host = int((ids < host_rows).sum())
    assert stats["host_tier_hits"] == on_host
    assert stats["device_tier_hits"] == 0
    assert stats["rows"] == ids.numel() - on_host  # the disk tier's rows only


@pytest.mark.parametrize("first_row, host_rows", [(1, 1), (700, 600), (1999, 1), (300, ROWS - 300)])
def test_tiers_from_a_first_row(table, reference, first_row, host_rows):
    table.place(host_rows=host_rows, first_row=first_row)
    assert table.resident_range == (first_row, first_row + host_rows)
    table.reset_stats()
    ids = request_ids(first_row)
    assert np.array_equal(table.gather_bytes(ids).numpy(), reference[ids.numpy()])
    resident = (ids >= first_row) & (ids < first_row + host_rows)
    stats = table.stats()
    assert stats["host_tier_hits"] == int(resident.sum())
    assert stats["rows"] == ids.numel() - int(resident.sum())


@pytest.mark.parametrize("threads", [3, 8])
def test_threads_leave_out_the_resident_ids_and_keep_request_order(table, reference, threads):
    """Each thread lists its slice's disk rows in place; the gaps the resident
    ids leave between slices are closed in order."""
    table.config = ple.GatherConfig(threads=threads)
    table.place(host_rows=600, first_row=700)
    table.reset_stats()
    ids = request_ids(threads, n=4000)
    ids[:2000] = torch.arange(700, 1300).repeat(4)[:2000]  # the first slices all resident
    assert np.array_equal(table.gather_bytes(ids).numpy(), reference[ids.numpy()])
    resident = (ids >= 700) & (ids < 1300)
    assert table.stats()["rows"] == ids.numel() - int(resident.sum())


def test_int32_ids_and_shapes_through_the_operator(table, reference):
    table.place(host_rows=700)
    ids = request_ids(3, 60).to(torch.int32).reshape(3, 4, 5)
    values = torch.ops.ple.disk_gather(ids, table.handle, torch.float32)
    table.place()
    assert same_values(values, torch.ops.ple.disk_gather(ids, table.handle, torch.float32))


def test_bad_ids_raise_before_any_row_is_written(table):
    table.place(host_rows=ROWS)
    out = torch.full((3, ROW_BYTES), 7, dtype=torch.uint8)
    with pytest.raises(IndexError, match=rf"row id {ROWS} at position 2 is out of range"):
        table.gather_bytes(torch.tensor([0, 5, ROWS]), out=out)
    assert bool((out == 7).all())


def test_prefetched_rows_with_tiers(table, reference):
    table.place(host_rows=500)
    ids = request_ids(4)
    table.prefetch(ids)
    rows = table.gather_bytes(ids)
    assert np.array_equal(rows.numpy(), reference[ids.numpy()])
    assert table.stats()["prefetch_hits"] == 1


def test_replacing_and_dropping_tiers(table, reference):
    ids = request_ids(5)
    for host_rows in (300, 1700, 0):
        table.place(host_rows=host_rows)
        assert table.resident_range == ((0, host_rows) if host_rows else (0, 0))
        assert np.array_equal(table.gather_bytes(ids).numpy(), reference[ids.numpy()])
    assert table.tiers is None


def test_a_place_that_fails_midway_leaves_no_tiers(table, reference):
    def interrupted(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        table.place(host_rows=ROWS, progress=interrupted)
    assert table.tiers is None and table.resident_range == (0, 0)
    ids = request_ids(2)
    assert np.array_equal(table.gather_bytes(ids).numpy(), reference[ids.numpy()])


def test_place_progress_reports_every_row(table):
    seen = []
    table.place(host_rows=ROWS, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (ROWS, ROWS)
    assert all(total == ROWS for _, total in seen)


def test_place_progress_true_shows_a_bar_and_none_shows_nothing(table, capsys):
    table.place(host_rows=ROWS, progress=True)
    bar = capsys.readouterr().err
    assert "placing emb" in bar and "100%" in bar
    table.place(host_rows=ROWS)
    table.place(host_rows=ROWS, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("args, error, message", [
    (dict(host_rows=-1), ValueError, "host_rows must be a non-negative int, got -1"),
    (dict(device_rows=1.5), ValueError, "device_rows must be a non-negative int, got 1.5"),
    (dict(host_rows=ROWS + 1), ValueError, f"first_row \\+ device_rows \\+ host_rows = {ROWS + 1} is more than"),
    (dict(host_rows=10, first_row=ROWS - 9), ValueError, f"= {ROWS + 1} is more than the {ROWS} rows"),
    (dict(host_rows=1, first_row=-1), ValueError, "first_row must be a non-negative int, got -1"),
    (dict(device_rows=1, device="cpu"), ValueError, "the device tier lives on a CUDA device, not cpu"),
])
def test_place_rejects_bad_splits(table, args, error, message):
    with pytest.raises(error, match=message):
        table.place(**args)
    assert table.tiers is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_device_tier_without_a_gpu_says_so(table):
    with pytest.raises(RuntimeError, match="device_rows needs a CUDA device, and none is available"):
        table.place(device_rows=10)


# The row cache ----------------------------------------------------------------

def test_cache_serves_repeated_rows_with_the_same_bytes(table, reference):
    table.config = ple.GatherConfig(row_cache_mib=1)
    ids = request_ids(6)
    table.reset_stats()
    first = table.gather_bytes(ids)
    second = table.gather_bytes(ids)
    assert np.array_equal(first.numpy(), reference[ids.numpy()])
    assert torch.equal(first, second)
    stats = table.stats()
    # First call: every row misses (duplicates too: the lookup precedes the
    # reads); second call: every row hits.
    assert stats["row_cache_misses"] == ids.numel()
    assert stats["row_cache_hits"] == ids.numel()
    assert stats["rows"] == 2 * ids.numel()


def test_a_small_cache_evicts_and_never_changes_bytes(tmp_path):
    # 1 MiB, the smallest budget, holds 256 of these 4 KiB rows: a quarter of the table.
    wide = write_byte_table([tmp_path / "wide.safetensors"], [1024], 4096, seed=5, family=False)
    with wide.table as table:
        rng = np.random.default_rng(5)
        calls = [torch.from_numpy(rng.integers(0, 1024, 300)) for _ in range(8)]
        table.config = ple.GatherConfig(row_cache_mib=1)
        for _ in range(2):
            for ids in calls:
                assert np.array_equal(table.gather_bytes(ids).numpy(), wide.reference[ids.numpy()])
        stats = table.stats()
    assert stats["row_cache_hits"] + stats["row_cache_misses"] == 2 * sum(i.numel() for i in calls)
    assert stats["row_cache_hits"] > 0
    # More misses than distinct rows: rows were evicted and read again.
    assert stats["row_cache_misses"] > len(np.unique(torch.cat(calls).numpy()))


def test_a_budget_that_cannot_be_had_changes_nothing(table):
    table.config = ple.GatherConfig(row_cache_mib=1)
    ids = request_ids(9, 100)
    table.gather_bytes(ids)
    with pytest.raises(MemoryError):
        table.config = ple.GatherConfig(row_cache_mib=1 << 40)
    assert table.config.row_cache_mib == 1
    table.reset_stats()
    table.gather_bytes(ids)
    assert table.stats()["row_cache_hits"] == ids.numel()


def test_cache_sits_behind_the_tiers(table, reference):
    table.config = ple.GatherConfig(row_cache_mib=1)
    table.place(host_rows=1000)
    table.reset_stats()
    ids = request_ids(7)
    table.gather_bytes(ids)
    table.gather_bytes(ids)
    stats = table.stats()
    disk = int((ids >= 1000).sum())
    assert stats["row_cache_hits"] + stats["row_cache_misses"] == 2 * disk
    assert stats["host_tier_hits"] == 2 * (ids.numel() - disk)


def test_placing_tiers_reads_past_the_row_cache(table):
    """The rows read into the tiers neither come from the cache nor go into
    it: the rows the cache held still hit after a place."""
    table.config = ple.GatherConfig(row_cache_mib=1)
    disk_ids = torch.arange(1500, 1600)
    table.gather_bytes(disk_ids)
    before = table.stats()
    table.place(host_rows=1000)
    after = table.stats()
    assert (after["row_cache_hits"], after["row_cache_misses"]) == (
        before["row_cache_hits"], before["row_cache_misses"])
    table.reset_stats()
    table.gather_bytes(disk_ids)
    assert table.stats()["row_cache_hits"] == disk_ids.numel()


def test_drop_page_cache_empties_the_row_cache(table):
    table.config = ple.GatherConfig(row_cache_mib=1)
    ids = request_ids(8, 100)
    table.gather_bytes(ids)
    table.drop_page_cache()
    table.reset_stats()
    table.gather_bytes(ids)
    assert table.stats()["row_cache_hits"] == 0


def test_row_cache_mib_is_validated():
    with pytest.raises(ValueError, match="row_cache_mib must be at least 0, got -1"):
        ple.GatherConfig(row_cache_mib=-1)


# The CUDA operator with tiers --------------------------------------------------

SPLITS = [(0, 0), (500, 0), (0, 700), (500, 700), (ROWS, 0), (0, ROWS), (1200, ROWS - 1200)]
FIRST_ROWS = [0, 300]


@needs_gpu
@pytest.mark.parametrize("first_row, device_rows, host_rows",
                         [(first, d, h) for first in FIRST_ROWS for d, h in SPLITS if first + d + h <= ROWS])
@pytest.mark.parametrize("n", [16, 9000])  # staged rows read over UVA, then from a device copy
def test_cuda_gather_with_every_split_equals_disk_only(table, first_row, device_rows, host_rows, n):
    ids = request_ids(device_rows + host_rows, n).cuda()
    expected = torch.ops.ple.disk_gather(ids.cpu(), table.handle, torch.bfloat16)
    table.place(device_rows=device_rows, host_rows=host_rows, device="cuda", first_row=first_row)
    table.reset_stats()  # place() itself gathered the resident rows
    values = torch.ops.ple.disk_gather(ids, table.handle, torch.bfloat16)
    assert same_values(values, expected)
    stats = table.stats()
    tier_row = ids - first_row
    on_device = (tier_row >= 0) & (tier_row < device_rows)
    on_host = (tier_row >= device_rows) & (tier_row < device_rows + host_rows)
    assert stats["device_tier_hits"] == int(on_device.sum())
    assert stats["host_tier_hits"] == int(on_host.sum())
    assert stats["rows"] == ids.numel() - int((on_device | on_host).sum())
    # With every row resident no host gather runs at all.
    assert stats["calls"] == (0 if device_rows + host_rows == ROWS else 1)


@needs_gpu
def test_cuda_with_everything_resident_touches_no_staging(table):
    table.place(device_rows=1000, host_rows=ROWS - 1000)
    table.reset_stats()
    torch.ops.ple.disk_gather(request_ids(1, 5000).cuda(), table.handle)
    torch.cuda.synchronize()
    staging = table.staging_for(torch.cuda.current_stream())
    assert staging.rows is None and staging.ids is None
    assert table.stats()["calls"] == 0


@needs_gpu
@pytest.mark.parametrize("n", [2, 1024, 5000])  # ids checked by every program; by a kernel first
def test_cuda_bad_id_with_everything_resident_gives_nan_then_raises(table, n):
    table.place(device_rows=ROWS)
    ids = torch.from_numpy(np.random.default_rng(n).integers(0, ROWS, n)).cuda()
    ids[n // 2] = ROWS
    table.reset_stats()
    values = torch.ops.ple.disk_gather(ids, table.handle, torch.float32)
    assert bool(values.isnan().all())
    assert table.stats()["device_tier_hits"] == n - 1  # the good rows were read
    torch.cuda.synchronize()  # the flag is written by the device; the next call reads it
    with pytest.raises(RuntimeError, match=rf"an id was out of range \[0, {ROWS}\)"):
        torch.ops.ple.disk_gather(torch.tensor([1], device="cuda"), table.handle)
    again = torch.ops.ple.disk_gather(torch.tensor([1], device="cuda"), table.handle)
    assert same_values(again, torch.ops.ple.disk_gather(torch.tensor([1]), table.handle))


@needs_gpu
def test_cuda_bad_id_is_still_reported_after_a_good_call_queued_behind_it(table):
    """Both calls are queued before the stream runs either (the stream sleeps
    first): the good call's kernel must not erase the bad call's report."""
    table.place(device_rows=ROWS)
    good, bad = torch.tensor([1], device="cuda"), torch.tensor([1, ROWS], device="cuda")
    torch.ops.ple.disk_gather(good, table.handle)  # compile before the stream is held up
    torch.cuda.synchronize()
    # Tens of ms on any GPU, while the host queues both calls (nothing below
    # waits for the stream before the synchronize).
    torch.cuda._sleep(100_000_000)
    bad_values = torch.ops.ple.disk_gather(bad, table.handle)
    good_values = torch.ops.ple.disk_gather(good, table.handle)
    torch.cuda.synchronize()
    assert bool(bad_values.isnan().all())
    assert same_values(good_values, torch.ops.ple.disk_gather(good.cpu(), table.handle))
    with pytest.raises(RuntimeError, match=rf"an id was out of range \[0, {ROWS}\)"):
        torch.ops.ple.disk_gather(good, table.handle)


@needs_gpu
@pytest.mark.parametrize("device_rows, host_rows", [(500, 700), (ROWS, 0)])
def test_cuda_graph_replays_with_tiers(table, device_rows, host_rows):
    table.place(device_rows=device_rows, host_rows=host_rows)
    static_ids = request_ids(0, 64).cuda()
    torch.ops.ple.disk_gather(static_ids, table.handle)  # warm up Triton outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.ple.disk_gather(static_ids, table.handle, torch.float32)
    for seed in range(1, 4):
        ids = request_ids(seed, 64).cuda()
        static_ids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.ops.ple.disk_gather(ids.cpu(), table.handle, torch.float32)
        assert same_values(static_out, expected)
    # Re-placing keeps the captured tiers alive: the old graph still replays its rows.
    table.place(host_rows=100)
    static_out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert same_values(static_out, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_device_tier_serves_only_its_own_gpu(table):
    table.place(device_rows=100, device="cuda:0")
    with pytest.raises(ValueError, match="keeps its device tier on cuda:0, and the ids are on cuda:1"):
        torch.ops.ple.disk_gather(torch.tensor([1], device="cuda:1"), table.handle)


@needs_gpu
def test_compiled_with_tiers(table):
    table.place(device_rows=300, host_rows=900)
    handle = table.handle

    def embed(ids):
        return torch.ops.ple.disk_gather(ids, handle, torch.float32) * 2

    compiled = torch.compile(embed, fullgraph=True, mode="reduce-overhead")
    for seed in range(3):
        ids = request_ids(seed, 128).cuda()
        assert same_values(compiled(ids), embed(ids.cpu()))
