"""The arms of the gather benchmark (tools/bench_gather.py): each runs the
same calls (seeded random ids) and returns a record of per-call figures.

  gathering arms  ple's gather with one prefetch policy (GatherConfig.from_spec),
                  or with direct I/O: direct (no row cache) and
                  direct-cache:MiB (a row cache of MiB), direct-block:BYTES
                  (reads of BYTES blocks), direct-depth:N (N reads in flight)
  numpy           NumPy fancy indexing of np.memmaps of the shards (warm)
  ceiling:DEPTH   the unique pages under each call's rows read with O_DIRECT
                  at queue depth DEPTH (tools/odirect.py); produces no rows
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import mmap
import os
import resource
import time
from pathlib import Path

import numpy as np
import torch

import ple
from ple_tools import odirect
from ple_tools.demo import disk_read_bytes
from ple_tools.make_table import PREFIX
from ple_tools.table_layout import PAGE, Layout


def major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def drop_files(paths) -> None:
    """posix_fadvise(DONTNEED) on each file: drops its clean pages that no
    process maps (unmap first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(paths) -> int:
    """The bytes of the files' pages that the page cache holds: mincore over
    a private mapping of each file (mapping and mincore read nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size,
                                                   access=mmap.ACCESS_COPY) as mapped:
            resident = np.zeros(-(-size // PAGE), dtype=np.uint8)
            start = ctypes.c_char.from_buffer(mapped)
            try:
                if libc.mincore(ctypes.addressof(start), size, resident.ctypes.data) != 0:
                    error = ctypes.get_errno()
                    raise OSError(error, f"mincore of {path}: {os.strerror(error)}")
            finally:
                del start  # the mapping closes only once nothing points into it
            total += int(np.count_nonzero(resident & 1)) * PAGE
    return total


def arm_kind(arm: str) -> tuple[str, int | None]:
    kind, _, value = arm.partition(":")
    return kind, int(value) if value else None


def new_record(arm: str, state: str) -> dict:
    return {"arm": arm, "state": state, "calls": []}


# The direct arms, and the GatherConfig field that each one's value sets.
DIRECT_FIELD = {"direct": None, "direct-cache": "row_cache_mib", "direct-block": "io_block_bytes",
                "direct-depth": "io_queue_depth"}


def arm_config(arm: str, threads: int | None, io_queue_depth: int | None = None) -> ple.GatherConfig:
    """The GatherConfig of a gathering arm: ``policy[:KiB]``, ``direct``,
    ``direct-cache:MiB``, ``direct-block:BYTES`` or ``direct-depth:N``."""
    fields = {"threads": threads} if threads else {}
    kind, value = arm_kind(arm)
    if kind in DIRECT_FIELD:
        if io_queue_depth:
            fields["io_queue_depth"] = io_queue_depth
        if DIRECT_FIELD[kind]:
            fields[DIRECT_FIELD[kind]] = value
        return ple.GatherConfig(io="direct", **fields)
    return ple.GatherConfig.from_spec(arm, **fields)


def run_gather_arm(table: ple.Table, layout: Layout, arm: str, requests, state: str,
                   drop: str, threads: int | None, io_queue_depth: int | None = None) -> dict:
    table.config = arm_config(arm, threads, io_queue_depth)
    out = torch.empty((len(requests[0]), layout.row_bytes), dtype=torch.uint8)
    out.fill_(0)  # fault the output buffer in outside the timed calls
    record = new_record(arm, state)
    record["io_backend"] = table.io_backend
    if state == "warm":  # untimed pass: every page (or row, direct) this arm asks for is cached after it
        for ids in requests:
            table.gather_bytes(ids, out=out)
    elif drop == "arm":
        drop_table(table, layout)
    digest = hashlib.sha256()
    for ids in requests:
        if state == "cold" and drop == "call":
            drop_table(table, layout)
        before, read0 = table.stats(), disk_read_bytes()
        cpu0, start = time.process_time(), time.perf_counter()
        table.gather_bytes(ids, out=out)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
        read, after = disk_read_bytes() - read0, table.stats()
        delta = {k: after[k] - before[k] for k in after}
        record["calls"].append({
            "ms": seconds * 1e3, "cpu_ms": cpu * 1e3, "read_bytes": read,
            "unique_pages": delta["unique_pages"], "direct_reads": delta["direct_reads"],
            "row_cache_hits": delta["row_cache_hits"],
            "resident_pages": delta["resident_pages"], "major_faults": delta["major_faults"],
            "advised_pages": delta["advised_pages"],
            "evicted_before_copy": delta["evicted_before_copy"],
            "max_advised_ahead_bytes": after["max_advised_ahead_bytes"]})
        digest.update(out.numpy().data)
    record["sha256"] = digest.hexdigest()
    return record


def drop_table(table: ple.Table | None, layout: Layout) -> None:
    """Unmaps the table's pages (madvise DONTNEED) and drops them from the page
    cache (and empties the row cache)."""
    if table is not None:
        table.drop_page_cache()
    drop_files(layout.paths)


def run_numpy_arm(layout: Layout, requests, state: str) -> dict:
    """NumPy fancy indexing of one np.memmap per shard (warm)."""
    maps = [np.memmap(layout.paths[f], dtype=np.uint8, mode="r", offset=int(off),
                      shape=(rows, layout.row_bytes))
            for f, off, rows in zip(layout.shard_file, layout.shard_offset, layout.shard_rows)]
    starts = layout.shard_starts

    def gather(ids: np.ndarray, out: np.ndarray) -> None:
        shard = np.searchsorted(starts, ids, side="right") - 1
        for s in np.unique(shard):
            where = np.flatnonzero(shard == s)
            out[where] = maps[s][ids[where] - starts[s]]

    ids_np = [ids.numpy() for ids in requests]
    out = np.zeros((len(ids_np[0]), layout.row_bytes), dtype=np.uint8)
    record = new_record("numpy", state)
    if state == "warm":
        for ids in ids_np:
            gather(ids, out)
    digest = hashlib.sha256()
    for ids in ids_np:
        faults0, read0 = major_faults(), disk_read_bytes()
        cpu0, start = time.process_time(), time.perf_counter()
        gather(ids, out)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
        record["calls"].append({
            "ms": seconds * 1e3, "cpu_ms": cpu * 1e3, "read_bytes": disk_read_bytes() - read0,
            "unique_pages": len(layout.pages(ids)), "major_faults": major_faults() - faults0,
            "advised_pages": 0, "evicted_before_copy": 0})
        digest.update(out.data)
    record["sha256"] = digest.hexdigest()
    del maps, gather  # unmap before anything drops the page cache again
    gc.collect()
    return record


def run_ceiling_arm(layout: Layout, arm: str, requests, drop: str, engine: str) -> dict:
    """Reads each call's unique pages with O_DIRECT (no page cache, no mmap) at
    queue depth DEPTH, with `engine` ("aio" or "threads"); only the reads are
    timed.  Produces no rows."""
    _, depth = arm_kind(arm)
    record = new_record(arm, "cold")
    fds = odirect.open_direct(layout.paths)
    max_pages = 32
    reader = None
    try:
        reader, record["engine"] = odirect.open_reader(engine, depth, max_pages * PAGE)
        if drop == "arm":
            drop_files(layout.paths)
        for ids in requests:
            keys = layout.pages(ids.numpy())
            reads, pages = odirect.page_reads(keys, fds, max_pages), len(keys)
            if drop == "call":
                drop_files(layout.paths)
            faults0, read0, cpu0 = major_faults(), disk_read_bytes(), time.process_time()
            start = time.perf_counter()
            got = reader.read(reads)
            seconds = time.perf_counter() - start
            record["calls"].append({
                "ms": seconds * 1e3, "read_bytes": disk_read_bytes() - read0,
                "direct_bytes": got, "unique_pages": pages, "reads": len(reads),
                "cpu_ms": (time.process_time() - cpu0) * 1e3,
                "major_faults": major_faults() - faults0, "advised_pages": 0,
                "evicted_before_copy": 0})
    finally:
        if reader is not None:
            reader.close()
        for fd in fds:
            os.close(fd)
    record["sha256"] = None
    return record


def run_arm(table_dir: Path, layout: Layout, arm: str, requests, state: str, drop: str,
            threads: int | None, engine: str, table: ple.Table | None = None,
            io_queue_depth: int | None = None) -> dict:
    """Runs one arm in this process.  `table`, when given, is an open table to
    reuse; otherwise one is opened (and closed) here."""
    kind, _ = arm_kind(arm)
    if kind == "ceiling":
        if table is not None:
            table.drop_page_cache()
        return run_ceiling_arm(layout, arm, requests, drop, engine)
    if kind == "numpy":
        return run_numpy_arm(layout, requests, state)
    if table is not None:
        return run_gather_arm(table, layout, arm, requests, state, drop, threads, io_queue_depth)
    with ple.Table.from_safetensors(table_dir, PREFIX) as own:
        return run_gather_arm(own, layout, arm, requests, state, drop, threads, io_queue_depth)


def new_pages_per_call(layout: Layout, requests, drop: str) -> list[int]:
    """Per call, its unique pages that no earlier call of the arm asked for:
    what a cold arm has to read when the cache is dropped only before the arm."""
    seen, counts = np.empty(0, dtype=np.int64), []
    for ids in requests:
        pages = layout.pages(ids.numpy())
        counts.append(len(pages) if drop == "call" else
                      len(pages) - int(np.isin(pages, seen, assume_unique=True).sum()))
        seen = np.union1d(seen, pages)
    return counts
