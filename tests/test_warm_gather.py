"""The gather's copy in request order (kernels/row_gather.cpp): warm slices
of a request are copied in request order, the rest of a slice that turns
cold goes to the sorted, advised path.  Bytes against the NumPy reference,
exact counters, the row named by a fault inside a batch, and the hand-over
from warm to cold."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers import ByteTable, run_threads, write_byte_table, write_sharded_table
from ple import GatherConfig, Table

SHARD_ROWS = (700, 700, 601)  # three shards over two files
NUM_ROWS = sum(SHARD_ROWS)
ROW_BYTES = (1, 17, 160, 4096, 8193)


@pytest.fixture(scope="module", params=ROW_BYTES, ids=lambda b: f"row_bytes={b}")
def sharded(request, tmp_path_factory) -> ByteTable:
    """Shards 0 and 2 in a.safetensors, shard 1 in b.safetensors, shifted off
    page alignment: rows straddle pages, shards and files."""
    fx = write_sharded_table(tmp_path_factory.mktemp(f"warm{request.param}"), SHARD_ROWS, request.param)
    yield fx
    fx.table.close()


def _request(seed: int, n: int = 3000) -> np.ndarray:
    """Random ids with many duplicates, and runs of neighbours that share pages."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, NUM_ROWS, n, dtype=np.int64)
    ids[::7] = ids[0]  # one id all over the request, in every thread's slice
    ids[100:160] = np.arange(690, 750)  # across the boundary of shards 0 and 1
    return ids


def _warm_up(fx: ByteTable) -> None:
    fx.table.gather_bytes(torch.arange(fx.table.num_rows))


@pytest.mark.parametrize("policy", ["window", "distance", "none"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_warm_request_matches_reference_with_exact_counters(sharded, policy, threads, dtype):
    fx = sharded
    fx.table.config = GatherConfig(policy, 4096, threads)
    _warm_up(fx)
    ids = _request(threads)
    fx.table.reset_stats()
    got = fx.table.gather_bytes(torch.from_numpy(ids).to(dtype)).numpy()
    assert np.array_equal(got, fx.reference[ids])
    s = fx.table.stats()
    assert s["rows"] == len(ids)
    assert s["unique_pages"] == fx.expected_pages(ids)
    assert s["advised_pages"] == 0 and s["major_faults"] == 0
    assert s["resident_pages"] == (s["unique_pages"] if policy != "none" else 0)


@pytest.mark.parametrize("threads", [1, 3])
def test_mixed_request_matches_reference(sharded, threads):
    """Some slices warm, some cold, some turning cold midway."""
    fx = sharded
    fx.table.config = GatherConfig("window", 64, threads)
    ids = _request(10 + threads)
    for warm in (ids[:1000], ids[1500:2000], np.arange(0, NUM_ROWS, 3)):
        fx.table.drop_page_cache()
        fx.table.gather_bytes(torch.from_numpy(warm))
        fx.table.reset_stats()
        got = fx.table.gather_bytes(torch.from_numpy(ids)).numpy()
        assert np.array_equal(got, fx.reference[ids])
        s = fx.table.stats()
        assert s["unique_pages"] == fx.expected_pages(ids)
        assert s["advised_pages"] + s["resident_pages"] <= s["unique_pages"]


@pytest.mark.parametrize("threads", [1, 3])
def test_resident_range_and_row_cache(sharded, threads):
    """Ids of the host tier are left to it and not counted; rows the row
    cache holds are served by it; the rest is copied with exact counters."""
    fx = sharded
    table = fx.table
    table.config = GatherConfig("window", 4096, threads)
    try:
        table.place(host_rows=300, first_row=600)
        _warm_up(fx)
        table.config = GatherConfig("window", 4096, threads, row_cache_mib=1)  # empty
        ids = _request(20 + threads)
        disk = ids[(ids < 600) | (ids >= 900)]
        for call in range(2):  # the second call finds rows in the row cache
            table.reset_stats()
            got = table.gather_bytes(torch.from_numpy(ids)).numpy()
            assert np.array_equal(got, fx.reference[ids]), f"call {call}"
            s = table.stats()
            assert s["rows"] == len(disk)
            assert s["row_cache_hits"] + s["row_cache_misses"] == len(disk)
            if call == 0:
                assert s["unique_pages"] == fx.expected_pages(disk)
            else:
                assert s["row_cache_hits"] > 0
    finally:
        table.place()
        table.config = GatherConfig()


def test_first_part_warm_second_part_cold_is_advised(tmp_path):
    """One thread: the copy in request order takes the warm rows, faults in
    the cold ones and hands them to the window, which advises them."""
    rows = 40_000
    fx = write_byte_table([tmp_path / "t.safetensors"], [rows], 160, seed=3, family=False,
                          config=GatherConfig("window", 256, 1))
    with fx.table as table:
        warm = np.arange(0, 8000, dtype=np.int64)
        cold = np.random.default_rng(4).integers(20_000, rows, 3000, dtype=np.int64)
        table.drop_page_cache()
        table.gather_bytes(torch.from_numpy(warm))
        table.reset_stats()
        ids = np.concatenate([warm, cold])
        assert np.array_equal(table.gather_bytes(torch.from_numpy(ids)).numpy(), fx.reference[ids])
        s = table.stats()
        assert s["advised_pages"] > 0, "the cold rows were not handed to the window"
        assert s["unique_pages"] == fx.expected_pages(ids)
        # The warm rows' pages but the last batch's (read up to 256 rows apart).
        assert s["resident_pages"] >= fx.expected_pages(warm[:-512])
        assert s["advised_pages"] + s["resident_pages"] <= s["unique_pages"]


def test_duplicates_across_threads_count_once(sharded):
    fx = sharded
    fx.table.config = GatherConfig("window", 4096, 3)
    _warm_up(fx)
    for ids in (np.full(3000, 5), np.tile(np.arange(690, 710), 150)):
        fx.table.reset_stats()
        assert np.array_equal(fx.table.gather_bytes(torch.from_numpy(ids)).numpy(), fx.reference[ids])
        s = fx.table.stats()
        assert s["unique_pages"] == s["resident_pages"] == fx.expected_pages(ids)


def test_concurrent_gathers_count_their_own_pages(sharded):
    """Gathers that run at once on one table each count their distinct pages."""
    fx = sharded
    fx.table.config = GatherConfig("window", 4096, 2)
    _warm_up(fx)
    requests = [[_request(100 * k + c, 1500) for c in range(20)] for k in range(4)]
    fx.table.reset_stats()
    failures = []

    def worker(k: int) -> None:
        for ids in requests[k]:
            if not np.array_equal(fx.table.gather_bytes(torch.from_numpy(ids)).numpy(),
                                  fx.reference[ids]):
                failures.append(k)

    run_threads(worker, 4)
    assert not failures
    expected = sum(fx.expected_pages(ids) for calls in requests for ids in calls)
    assert fx.table.stats()["unique_pages"] == expected


def test_page_marks_survive_their_number_wrapping(tmp_path):
    """A gather's marks carry its 16-bit number: gather 65,536 has the
    number of the first again, and still counts the page that the first
    one marked."""
    fx = write_byte_table([tmp_path / "t.safetensors"], [100], 160, seed=5, family=False,
                          config=GatherConfig("window", 4096, 1))
    with fx.table as table:
        a, b = torch.tensor([0]), torch.tensor([99])
        table.gather_bytes(a)
        for _ in range(65_534):
            table.gather_bytes(b)
        table.reset_stats()
        table.gather_bytes(a)
        assert table.stats()["unique_pages"] == fx.expected_pages([0])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("position", [0, 5, 15, 16, 40])
def test_a_fault_inside_a_batch_names_its_row(tmp_path, threads, position):
    """A warm request with one row past the end of a truncated file: the
    batch that holds it faults, and the error names that row."""
    rows, row_bytes = 50_000, 160
    reference = np.random.default_rng(6).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    path = tmp_path / "t.safetensors"
    save_file({"t": torch.from_numpy(reference)}, str(path))
    with Table.from_safetensors(path, config=GatherConfig("window", 4096, threads)) as table:
        kept = np.random.default_rng(7).integers(0, rows // 3, 1000)
        table.gather_bytes(torch.from_numpy(kept))  # warm
        os.truncate(path, os.path.getsize(path) // 2)
        ids = kept.copy()
        ids[position] = rows - 1
        with pytest.raises(OSError, match=rf"{path}, byte \d+: row {rows - 1} could not be read"):
            table.gather_bytes(torch.from_numpy(ids))
        assert np.array_equal(table.gather_bytes(torch.from_numpy(kept)).numpy(), reference[kept])
