"""The native gather against an independent NumPy reference, its counters,
its input checks and its thread safety.

Tables are U8 safetensors tensors of width ``row_bytes``, so a row's values are
its raw bytes and the reference is simply the random array that was written.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import ByteTable, run_threads, write_byte_table, write_sharded_table
from ple import GatherConfig
from ple.config import POLICIES

SHARD_ROWS = (97, 97, 77)
NUM_ROWS = sum(SHARD_ROWS)  # 271
BOUNDARY_ROWS = (0, NUM_ROWS - 1, 96, 97, 193, 194)
ROW_BYTES = (1, 17, 160, 4096, 8193)
WINDOWS_KIB = (0, 4, 4096, 1 << 20)
THREADS = (1, 3)
REQUEST = 2000
COUNTER_KEYS = {
    "calls", "rows", "unique_pages", "advised_pages", "resident_pages", "evicted_before_copy",
    "max_advised_ahead_bytes", "bytes_copied", "major_faults", "minor_faults", "gather_ns",
    "prefetch_hits", "prefetch_misses", "row_cache_hits", "row_cache_misses", "prefetch_pinned_rows",
    "direct_reads", "direct_read_bytes", "device_tier_hits", "host_tier_hits",
}


# ---------------------------------------------------------------- helpers


def _sharded_fixture(directory: Path, row_bytes: int, seed: int) -> ByteTable:
    """Shard family ``t.shard_{0,1,2}.weight`` of 97, 97, 77 rows: shards 0
    and 2 in a.safetensors, shard 1 in b.safetensors, each file also holding a
    small 1-D tensor that shifts the shards off page alignment."""
    fx = write_sharded_table(directory, SHARD_ROWS, row_bytes, seed=seed,
                             config=GatherConfig(threads=1))
    assert fx.table.num_rows == NUM_ROWS and fx.table.row_bytes == row_bytes
    return fx


def _request(rng: np.random.Generator, num_rows: int = NUM_ROWS, n: int = REQUEST) -> np.ndarray:
    """~n random ids with duplicates, plus the first, last and shard-boundary
    rows at random places."""
    ids = rng.integers(0, num_rows, n, dtype=np.int64)
    specials = [r for r in BOUNDARY_ROWS if r < num_rows]
    places = rng.choice(n, len(specials), replace=False)
    ids[places] = specials
    return ids


def _gather(fx: ByteTable, ids) -> np.ndarray:
    out = fx.table.gather_bytes(torch.as_tensor(ids))
    assert out.dtype == torch.uint8
    assert tuple(out.shape) == (*np.shape(ids), fx.row_bytes)
    return out.numpy()


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=ROW_BYTES, ids=lambda b: f"row_bytes={b}")
def sharded(request, tmp_path_factory) -> ByteTable:
    row_bytes = request.param
    fx = _sharded_fixture(tmp_path_factory.mktemp(f"sharded{row_bytes}"), row_bytes, row_bytes)
    yield fx
    fx.table.close()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> ByteTable:
    fx = _sharded_fixture(tmp_path_factory.mktemp("small"), 160, 12345)
    yield fx
    fx.table.close()


BIG_ROWS, BIG_ROW_BYTES = 20000, 160  # ~3.2 MB: enough pages to be cold


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> ByteTable:
    """A single (non-sharded) 2-D tensor table."""
    fx = write_byte_table([tmp_path_factory.mktemp("big") / "big.safetensors"], [BIG_ROWS],
                          BIG_ROW_BYTES, seed=7, family=False, pads=(333,),
                          config=GatherConfig(threads=1))
    assert fx.table.num_rows == BIG_ROWS and fx.table.row_bytes == BIG_ROW_BYTES
    yield fx
    fx.table.close()


# ---------------------------------------------------------------- bytes


@pytest.mark.parametrize("threads", THREADS, ids=lambda t: f"threads={t}")
@pytest.mark.parametrize("window", WINDOWS_KIB, ids=lambda w: f"kib={w}")
@pytest.mark.parametrize("policy", POLICIES)
def test_gather_matches_reference_cold_and_warm(sharded, policy, window, threads):
    fx = sharded
    table = fx.table
    table.config = GatherConfig(policy=policy, prefetch_window_kib=window, threads=threads)
    rng = np.random.default_rng([fx.row_bytes, POLICIES.index(policy), window, threads])
    ids = _request(rng)
    expected_pages = fx.expected_pages(ids)
    advises = policy != "none" and window > 0

    for state in ("cold", "warm"):
        if state == "cold":
            table.drop_page_cache()
        table.reset_stats()
        got = _gather(fx, ids)
        assert np.array_equal(got, fx.reference[ids]), f"{state} gather differs from reference"

        s = table.stats()
        assert s["calls"] == 1
        assert s["rows"] == len(ids)
        assert s["bytes_copied"] == len(ids) * fx.row_bytes
        assert s["unique_pages"] == expected_pages
        assert s["advised_pages"] + s["resident_pages"] <= s["unique_pages"]
        if not advises:
            assert s["advised_pages"] == 0
            assert s["max_advised_ahead_bytes"] == 0
        if policy == "all" and advises:
            assert s["advised_pages"] == s["unique_pages"] - s["resident_pages"]
        if policy == "window":
            assert s["max_advised_ahead_bytes"] <= window * 1024
        if state == "cold" and advises:
            # Proves the table really was cold.
            assert s["advised_pages"] > 0
        if state == "warm":
            assert s["major_faults"] == 0 and s["evicted_before_copy"] == 0
        if state == "warm" and advises:
            assert s["advised_pages"] == 0
            if policy in ("window", "all"):
                assert s["resident_pages"] == s["unique_pages"]


def test_single_tensor_table(big):
    rng = np.random.default_rng(1)
    ids = _request(rng, BIG_ROWS, 3000)
    ids[:3] = [0, BIG_ROWS - 1, BIG_ROWS // 2]
    for config in (GatherConfig("window", 64, 1), GatherConfig("all", 4096, 3),
                   GatherConfig("none", 0, 2)):
        big.table.config = config
        big.table.drop_page_cache()
        assert np.array_equal(_gather(big, ids), big.reference[ids]), config


def test_2d_ids_keep_shape_and_order(small):
    rng = np.random.default_rng(2)
    ids = rng.integers(0, NUM_ROWS, (7, 9), dtype=np.int64)
    ids[0, 0], ids[-1, -1], ids[3, 4] = 0, NUM_ROWS - 1, 97
    small.table.config = GatherConfig("window", 4, 1)
    got = _gather(small, ids)
    assert got.shape == (7, 9, small.row_bytes)
    assert np.array_equal(got, small.reference[ids])


def test_3d_ids(small):
    ids = np.random.default_rng(3).integers(0, NUM_ROWS, (2, 3, 5), dtype=np.int64)
    assert np.array_equal(_gather(small, ids), small.reference[ids])


@pytest.mark.parametrize("threads", THREADS)
def test_int32_ids(small, threads):
    ids = _request(np.random.default_rng(4)).astype(np.int32)
    small.table.config = GatherConfig("window", 4096, threads)
    got = small.table.gather_bytes(torch.from_numpy(ids))
    assert np.array_equal(got.numpy(), small.reference[ids.astype(np.int64)])
    assert small.table.stats()["rows"] >= len(ids)


def test_non_contiguous_ids(small):
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, NUM_ROWS, (40, 30)))
    view = ids.t()
    assert not view.is_contiguous()
    got = small.table.gather_bytes(view).numpy()
    assert got.shape == (30, 40, small.row_bytes)
    assert np.array_equal(got, small.reference[view.numpy()])
    strided = ids.reshape(-1)[::7]
    assert np.array_equal(small.table.gather_bytes(strided).numpy(),
                          small.reference[strided.numpy()])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_scalar_id(small, dtype):
    got = small.table.gather_bytes(torch.tensor(194, dtype=dtype))
    assert tuple(got.shape) == (small.row_bytes,)
    assert np.array_equal(got.numpy(), small.reference[194])


def test_python_list_ids(small):
    ids = [270, 0, 97, 96, 97]
    assert np.array_equal(small.table.gather_bytes(ids).numpy(), small.reference[ids])


def test_gather_into_out(small):
    ids = _request(np.random.default_rng(6), n=600)
    out = torch.full((len(ids), small.row_bytes), 0xA5, dtype=torch.uint8)
    small.table.config = GatherConfig("window", 4, 3)
    result = small.table.gather_bytes(torch.from_numpy(ids), out=out)
    assert result is out
    assert np.array_equal(out.numpy(), small.reference[ids])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4)])
def test_empty_ids(small, dtype, shape):
    small.table.reset_stats()
    got = small.table.gather_bytes(torch.empty(shape, dtype=dtype))
    assert got.dtype == torch.uint8
    assert tuple(got.shape) == (*shape, small.row_bytes)
    s = small.table.stats()
    assert s["rows"] == 0 and s["bytes_copied"] == 0 and s["unique_pages"] == 0


# ---------------------------------------------------------------- counters


def _cold_gather(big: ByteTable, config: GatherConfig, seed: int) -> tuple[np.ndarray, dict]:
    """2,000 random ids of ``big`` gathered from a cold page cache with
    ``config``, checked against the reference; the ids and the call's stats."""
    table = big.table
    table.config = config
    ids = np.random.default_rng(seed).integers(0, BIG_ROWS, 2000, dtype=np.int64)
    table.drop_page_cache()
    table.reset_stats()
    assert np.array_equal(_gather(big, ids), big.reference[ids])
    return ids, table.stats()


@pytest.mark.parametrize("window", [4, 64])
@pytest.mark.parametrize("threads", THREADS)
def test_window_bounds_advice_ahead_cold(big, window, threads):
    table = big.table
    ids, s = _cold_gather(big, GatherConfig("window", window, threads), seed=window + threads)
    assert s["advised_pages"] > 0, "drop_page_cache did not make the table cold"
    assert 0 < s["max_advised_ahead_bytes"] <= window * 1024
    # 3 MB of pages and no memory pressure: no advised page is reclaimed.
    assert s["evicted_before_copy"] == 0
    assert s["unique_pages"] == big.expected_pages(ids)
    assert s["advised_pages"] + s["resident_pages"] <= s["unique_pages"]

    # Warm: everything resident, nothing advised.
    table.reset_stats()
    assert np.array_equal(_gather(big, ids), big.reference[ids])
    s = table.stats()
    assert s["advised_pages"] == 0
    assert s["resident_pages"] == s["unique_pages"] == big.expected_pages(ids)
    assert s["max_advised_ahead_bytes"] == 0
    assert s["major_faults"] == 0 and s["evicted_before_copy"] == 0


@pytest.mark.parametrize("policy", ["window", "distance"])
def test_warm_start_then_cold_pages_hand_over_to_the_window(big, policy):
    """A chunk whose first pages are resident is copied without mincore until
    a batch of rows takes a major fault; the rest is then read with advice.
    ``big`` is one tensor in one file, so addresses ascend with ids."""
    table = big.table
    table.config = GatherConfig(policy, 64, 1)
    warm = np.arange(0, 4000, dtype=np.int64)
    cold = np.random.default_rng(3).integers(10000, BIG_ROWS, 2000, dtype=np.int64)
    table.drop_page_cache()
    _gather(big, warm)
    table.reset_stats()
    ids = np.concatenate([cold, warm])
    assert np.array_equal(_gather(big, ids), big.reference[ids])
    s = table.stats()
    assert s["advised_pages"] > 0, "the cold rows were not handed to the window"
    assert s["resident_pages"] >= big.expected_pages(warm[:256]) - 1
    assert s["advised_pages"] + s["resident_pages"] <= s["unique_pages"]


@pytest.mark.parametrize("policy,window", [("window", 4), ("window", 64), ("distance", 4),
                                           ("all", 4)])
def test_cold_table_reports_no_resident_pages(big, policy, window):
    """After drop_page_cache no page of the table is resident, so a gather
    should find none resident: ``resident_pages`` counts pages that were
    already in memory, not pages this gather's own copy faulted in before
    the advice loop got to them."""
    _, s = _cold_gather(big, GatherConfig(policy, window, 1), seed=17)
    assert s["resident_pages"] == 0, (
        f"cold table, yet {s['resident_pages']} of {s['unique_pages']} pages counted resident "
        f"({s['advised_pages']} advised, {s['major_faults']} major faults)")
    # A one-page window cannot cover both pages of a row that straddles a page
    # boundary: the copy faults the second one in synchronously.
    assert s["advised_pages"] + s["major_faults"] == s["unique_pages"]
    if window > 4:
        assert s["major_faults"] == 0


@pytest.mark.parametrize("threads", THREADS)
def test_all_advises_every_cold_page(big, threads):
    ids, s = _cold_gather(big, GatherConfig("all", 4, threads), seed=11 + threads)
    assert s["unique_pages"] == big.expected_pages(ids)
    assert s["advised_pages"] > 0
    assert s["advised_pages"] == s["unique_pages"] - s["resident_pages"]
    # Every cold page was advised before the copy: no major faults, no evictions.
    assert s["evicted_before_copy"] == 0
    assert s["major_faults"] == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_no_advice_with_window_zero_cold(big, policy):
    window = 0 if policy != "none" else 4096
    ids, s = _cold_gather(big, GatherConfig(policy, window, 1), seed=21)
    assert s["advised_pages"] == 0
    assert s["max_advised_ahead_bytes"] == 0
    assert s["unique_pages"] == big.expected_pages(ids)
    # Unadvised cold pages are read by the copy's own faults (MADV_RANDOM:
    # one page per fault), and nothing advised can have been evicted.
    assert 0 < s["major_faults"] <= s["unique_pages"]
    assert s["evicted_before_copy"] == 0


def test_calls_rows_and_bytes_accumulate(small):
    table = small.table
    table.config = GatherConfig("window", 64, 1)
    table.reset_stats()
    sizes = [5, 1, 300, 0, 17]
    rng = np.random.default_rng(31)
    for k, n in enumerate(sizes, start=1):
        table.gather_bytes(torch.from_numpy(rng.integers(0, NUM_ROWS, n)))
        s = table.stats()
        assert s["calls"] == k
        assert s["rows"] == sum(sizes[:k])
        assert s["bytes_copied"] == sum(sizes[:k]) * small.row_bytes


def test_stats_keys_and_reset(small):
    table = small.table
    table.config = GatherConfig("all", 4096, 1)
    table.drop_page_cache()
    table.gather_bytes(torch.from_numpy(_request(np.random.default_rng(41))))
    s = table.stats()
    assert set(s) == COUNTER_KEYS
    assert all(isinstance(v, int) and v >= 0 for v in s.values())
    assert s["calls"] >= 1 and s["rows"] > 0 and s["gather_ns"] > 0
    table.reset_stats()
    assert table.stats() == dict.fromkeys(COUNTER_KEYS, 0)


# ---------------------------------------------------------------- bad input


BAD_IDS = (NUM_ROWS, -1, 2**40)


@pytest.mark.parametrize("dtype,bad", [(torch.int64, b) for b in BAD_IDS]
                         + [(torch.int32, b) for b in BAD_IDS if b < 2**31])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("threads", THREADS)
def test_bad_id_raises_and_writes_nothing(small, bad, where, dtype, threads):
    table = small.table
    table.config = GatherConfig("window", 4, threads)
    ids = _request(np.random.default_rng(51), n=3000)
    ids[{"first": 0, "middle": 1500, "last": len(ids) - 1}[where]] = bad
    ids_t = torch.from_numpy(ids).to(dtype)
    out = torch.full((len(ids), small.row_bytes), 0xA5, dtype=torch.uint8)
    before = table.stats()
    with pytest.raises(IndexError) as info:
        table.gather_bytes(ids_t, out=out)
    message = str(info.value)
    assert str(bad) in message
    assert f"[0, {NUM_ROWS})" in message
    assert bool((out == 0xA5).all()), "out was written before the bad id was found"
    after = table.stats()
    assert after["rows"] == before["rows"] and after["bytes_copied"] == before["bytes_copied"]
    # Without out= it raises the same way.
    with pytest.raises(IndexError, match=r"\[0, 271\)"):
        table.gather_bytes(ids_t)


def test_bad_id_in_2d_request(small):
    ids = torch.zeros((4, 5), dtype=torch.int64)
    ids[3, 4] = NUM_ROWS
    with pytest.raises(IndexError, match=str(NUM_ROWS)):
        small.table.gather_bytes(ids)


@pytest.mark.parametrize("out", [
    pytest.param(lambda n, rb: torch.full((n, rb + 1), 7, dtype=torch.uint8), id="wide"),
    pytest.param(lambda n, rb: torch.full((n + 1, rb), 7, dtype=torch.uint8), id="long"),
    pytest.param(lambda n, rb: torch.full((n * rb,), 7, dtype=torch.uint8), id="flat"),
    pytest.param(lambda n, rb: torch.full((n, rb), 7, dtype=torch.int8), id="int8"),
    pytest.param(lambda n, rb: torch.full((n, rb), 7.0, dtype=torch.float32), id="float32"),
    pytest.param(lambda n, rb: torch.full((rb, n), 7, dtype=torch.uint8).t(), id="non_contiguous"),
])
def test_bad_out_raises_value_error(small, out):
    ids = torch.from_numpy(np.random.default_rng(61).integers(0, NUM_ROWS, 10))
    bad_out = out(10, small.row_bytes)
    sentinel = bad_out.clone()
    with pytest.raises(ValueError):
        small.table.gather_bytes(ids, out=bad_out)
    assert torch.equal(bad_out, sentinel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_bad_ids_dtype_raises_type_error(small, dtype):
    with pytest.raises(TypeError):
        small.table.gather_bytes(torch.zeros(4, dtype=dtype))


# ---------------------------------------------------------------- threads


def test_concurrent_python_threads(big):
    table = big.table
    table.config = GatherConfig("window", 64, 2)
    table.drop_page_cache()
    table.reset_stats()
    n_threads, calls = 8, 50
    barrier = threading.Barrier(n_threads)
    counts = [0] * n_threads
    failures: list[str] = []

    def worker(k: int) -> None:
        rng = np.random.default_rng(1000 + k)
        try:
            barrier.wait()
            for c in range(calls):
                ids = rng.integers(0, BIG_ROWS, int(rng.integers(1, 1200)), dtype=np.int64)
                got = table.gather_bytes(torch.from_numpy(ids)).numpy()
                counts[k] += len(ids)
                if not np.array_equal(got, big.reference[ids]):
                    failures.append(f"thread {k} call {c}: bytes differ")
        except Exception as e:  # noqa: BLE001  (reported below)
            failures.append(f"thread {k}: {e!r}")

    run_threads(worker, n_threads)
    assert not failures, failures[:5]
    s = table.stats()
    assert s["calls"] == n_threads * calls
    assert s["rows"] == sum(counts)
    assert s["bytes_copied"] == sum(counts) * BIG_ROW_BYTES


def test_concurrent_gathers_while_reconfiguring_and_dropping(big):
    """Config changes and page-cache drops from another thread change how rows
    are read, never which bytes come back."""
    table = big.table
    table.reset_stats()
    stop = threading.Event()
    failures: list[str] = []
    counts = [0] * 4

    def meddler() -> None:
        configs = [GatherConfig(p, w, t) for p in POLICIES for w in (0, 4, 64) for t in (1, 3)]
        k = 0
        while not stop.is_set():
            table.config = configs[k % len(configs)]
            if k % 5 == 0:
                table.drop_page_cache()
            k += 1
            time.sleep(0.0005)

    def worker(k: int) -> None:
        rng = np.random.default_rng(2000 + k)
        try:
            for _ in range(30):
                ids = rng.integers(0, BIG_ROWS, int(rng.integers(1, 2000)), dtype=np.int64)
                got = table.gather_bytes(torch.from_numpy(ids)).numpy()
                counts[k] += len(ids)
                if not np.array_equal(got, big.reference[ids]):
                    failures.append(f"thread {k}: bytes differ")
        except Exception as e:  # noqa: BLE001
            failures.append(f"thread {k}: {e!r}")

    m = threading.Thread(target=meddler)
    m.start()
    run_threads(worker, len(counts))
    stop.set()
    m.join()
    assert not failures, failures[:5]
    s = table.stats()
    assert s["calls"] == 30 * len(counts)
    assert s["rows"] == sum(counts)
