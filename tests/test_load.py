"""Load tests: many Python threads on one and on several tables, and many
calls on one table without growth in memory or leftover files and mappings.

(a) 16 Python threads gather random ids (1-3000 per call) for
``PLE_LOAD_SECONDS`` seconds (default 3; the long form runs
30 s: ``PLE_LOAD_SECONDS=30 pytest tests/test_load.py``), from one table and
then from 4 tables at once (rows of 160 and 17 bytes, each table with its own
policy, window and threads); every result must equal the reference byte for
byte, and each table's ``calls`` and ``rows`` counters must add up to what
the threads asked of it.

(b) 10,000 calls of 1-5000 rows on a 20 MiB table: resident memory after them
stays within a bound of what it was after 500 warm-up calls, and once the
table is closed no file descriptor or mapping of its file is left.

(a) runs again on CUDA when there is a GPU: each thread gathers with CUDA
ids on its own stream (the host gathers run inside the streams), and the
decoded values (U8 rows, scale 1) must equal the reference bytes.

Only counts and bytes are asserted, never times: the number of calls in (a)
depends on the machine, what is checked about them does not.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple
from helpers import ByteTable, run_threads, write_byte_table
from ple import GatherConfig

LOAD_SECONDS = float(os.environ.get("PLE_LOAD_SECONDS", 3))
THREADS = 16
MAX_REQUEST = 3000


def _write(directory: Path, name: str, shard_rows: list[int], row_bytes: int,
           config: GatherConfig, seed: int) -> ByteTable:
    """One tensor in one file, or a shard family whose shards alternate
    between two files, each behind a small padding tensor."""
    family = len(shard_rows) > 1
    paths = ([directory / f"{name}_{f}.safetensors" for f in range(2)] if family
             else [directory / f"{name}.safetensors"])
    written = write_byte_table(paths, shard_rows, row_bytes, seed=seed, family=family,
                               pads=(101, 102) if family else (37,), tensor="t", config=config)
    assert written.table.shard_rows == shard_rows and written.table.row_bytes == row_bytes
    return written


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("load")
    made = [
        _write(d, "a", [1500, 1500, 1000], 160, GatherConfig("window", 64, 2), 1),
        _write(d, "b", [3000], 17, GatherConfig("distance", 4, 3), 2),
        _write(d, "c", [2500], 160, GatherConfig("all", 4096, 1), 3),
        _write(d, "d", [2000, 1100], 17, GatherConfig("none", 0, 2), 4),
    ]
    yield made
    for t in made:
        t.table.close()


def _hammer(tables: list[ByteTable], on_cuda: bool = False) -> None:
    """THREADS threads gather from ``tables`` for LOAD_SECONDS; then each table's
    counters must equal the calls and rows the threads made of it."""
    for t in tables:
        t.table.reset_stats()
    calls = np.zeros((THREADS, len(tables)), dtype=np.int64)
    rows = np.zeros((THREADS, len(tables)), dtype=np.int64)
    failures: list[str] = []
    barrier = threading.Barrier(THREADS)

    def worker(k: int) -> None:
        rng = np.random.default_rng(100 + k)
        try:
            stream = torch.cuda.Stream() if on_cuda else None
            barrier.wait()
            deadline = time.monotonic() + LOAD_SECONDS
            while True:
                j = int(rng.integers(len(tables)))
                t = tables[j]
                ids = rng.integers(0, t.table.num_rows, int(rng.integers(1, MAX_REQUEST + 1)))
                ids_t = torch.from_numpy(ids).to(torch.int32 if rng.random() < 0.3 else torch.int64)
                if on_cuda:
                    with torch.cuda.stream(stream):
                        values = torch.ops.ple.disk_gather(ids_t.cuda(), t.table.handle)
                        got = values.cpu().to(torch.uint8)  # U8 rows at scale 1: exact
                elif rng.random() < 0.5:
                    got = t.table.gather_bytes(ids_t)
                else:
                    got = torch.ops.ple.disk_gather_bytes(ids_t, t.table.handle)
                calls[k, j] += 1
                rows[k, j] += len(ids)
                if not np.array_equal(got.numpy(), t.reference[ids]):
                    failures.append(f"thread {k}, table {j}, {len(ids)} ids: bytes differ")
                if time.monotonic() >= deadline or len(failures) > 10:
                    break
        except Exception as error:  # noqa: BLE001  (reported below)
            failures.append(f"thread {k}: {error!r}")

    run_threads(worker, THREADS)
    assert not failures, failures[:5]
    assert (calls.sum(axis=1) >= 1).all()
    for j, t in enumerate(tables):
        s = t.table.stats()
        assert s["calls"] == calls[:, j].sum(), f"table {j}"
        assert s["rows"] == rows[:, j].sum(), f"table {j}"
        assert s["bytes_copied"] == rows[:, j].sum() * t.table.row_bytes, f"table {j}"


def test_sixteen_threads_on_one_table(tables):
    _hammer(tables[:1])


def test_sixteen_threads_on_four_tables(tables):
    _hammer(tables)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sixteen_threads_on_cuda_streams(tables):
    _hammer(tables[:1], on_cuda=True)
    _hammer(tables, on_cuda=True)


# ---------------------------------------------------------------- (b) memory and files

MIB = 1 << 20
TABLE_ROWS, TABLE_ROW_BYTES = 131_072, 160  # 20 MiB
WARMUP_CALLS, CALLS, MAX_CALL_ROWS = 500, 10_000, 5000
# Resident growth allowed between the end of the warm-up and the end of the
# calls.  The table's pages count in VmRSS once this process maps them: at
# most the whole 20 MiB file (the warm-up's 1.25 M random ids touch nearly all
# of its 5,120 pages already, so little of that is still to come).  Every
# call's own memory (ids, sorted row list, 0.8 MB output at most) is freed
# before the next; what the allocator keeps of it is bounded by the largest
# call, per arena, a few MiB.  64 MiB holds both with room, while any leak of
# a call's output (400 KB on average, 4 GB over 10,000 calls), of its row list
# (40 KB on average, 400 MB) or of a few KiB per call (over 64 MiB from about
# 7 KiB) fails it.
RSS_GROWTH_BOUND = 64 * MIB


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _fds_to(path: str) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == path:
                found.append(fd)
        except OSError:  # closed meanwhile (the listing's own fd)
            pass
    return found


def _mappings_of(path: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.rstrip() for line in f if path in line]


def test_many_calls_keep_memory_flat_and_close_releases_everything(tmp_path):
    rng = np.random.default_rng(7)
    reference = rng.integers(0, 256, (TABLE_ROWS, TABLE_ROW_BYTES), dtype=np.uint8)
    path = tmp_path / "big.safetensors"
    save_file({"t": torch.from_numpy(reference)}, str(path))
    real = os.path.realpath(path)
    configs = [GatherConfig(p, w, t) for p, w, t in
               [("window", 4096, 2), ("window", 64, 1), ("distance", 256, 2), ("all", 4096, 2),
                ("none", 0, 1)]]

    table = ple.Table.from_safetensors(path)

    def calls(n: int) -> None:
        for c in range(n):
            if c % 500 == 0:
                table.config = configs[(c // 500) % len(configs)]
            ids = rng.integers(0, TABLE_ROWS, int(rng.integers(1, MAX_CALL_ROWS + 1)))
            if c % 3 == 0:
                ids = ids.astype(np.int32)
            got = table.gather_bytes(torch.from_numpy(ids))
            if c % 97 == 0:  # a sample: the bytes are the subject of other tests
                assert np.array_equal(got.numpy(), reference[ids])
            del got

    calls(WARMUP_CALLS)
    gc.collect()
    rss_warm = _status_kib("VmRSS") * 1024
    table.reset_stats()
    calls(CALLS)
    gc.collect()
    rss_end = _status_kib("VmRSS") * 1024
    s = table.stats()
    assert s["calls"] == CALLS
    growth = rss_end - rss_warm
    assert growth < RSS_GROWTH_BOUND, (
        f"VmRSS grew by {growth / MIB:.1f} MiB over {CALLS} calls "
        f"({rss_warm / MIB:.1f} -> {rss_end / MIB:.1f} MiB; RssAnon {_status_kib('RssAnon')} KiB, "
        f"RssFile {_status_kib('RssFile')} KiB)")

    # While open, the scans do see the table (else they would prove nothing).
    assert _fds_to(real), "the open table holds no fd of its file: the scan is wrong"
    assert _mappings_of(real), "the open table maps nothing of its file: the scan is wrong"

    table.close()
    del table
    gc.collect()
    assert _fds_to(real) == [], f"fds still open on {real} after close()"
    assert _mappings_of(real) == [], f"mappings of {real} left after close(): {_mappings_of(real)}"
