"""Benchmarks the gather's prefetch policies against each other, against NumPy
and against what the disk serves, cold, warm and under memory pressure.

    python tools/bench_gather.py [--table-gib 8] [--calls 16] [--rows 18000]
                                 [--windows 64,1024,4096,16384] [--warm]
                                 [--memory-limit MiB --ballast MiB]
                                 [--json PATH] [--plot PATH] [--quick]

Arms, each running the same calls with the same seeded random ids:

  none            no advice: every cold page is a synchronous fault
  all             every cold page advised first, then copied (the old operator)
  distance:KiB    the seed's rule: pages less than KiB ahead of the copy address
  window:KiB      at most KiB of pages advised and not yet copied, per gather
                  thread (--threads; one arm per --windows value)
  ceiling:DEPTH   not a gather: the unique 4 KiB pages under each call's rows,
                  read with O_DIRECT (no page cache, no mmap) with DEPTH reads
                  in flight (Linux AIO, or --ceiling-engine threads: a pool of
                  DEPTH threads): what this disk serves for this access
                  pattern at that depth.  Produces no rows; reports time and
                  bytes.  (The gather's own queue can be deeper than DEPTH.)
  numpy           (warm only) NumPy fancy indexing of np.memmaps of the shards

Before the arms, the unique pages of every call are read once with O_DIRECT
(untimed for the arms; reported as the row prime:DEPTH).  A virtual disk's
host may cache what the guest reads (on the development machine, re-reading
the same random pages is 2.5x faster than reading them first), and every arm
reads the same pages: without this pass the first arm would pay for reads
that later arms get from the host's cache.  --no-prime skips it.

Every gathering arm must return the same bytes (SHA-256 over all calls); the
tool exits non-zero when they differ or an arm fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import errno
import gc
import hashlib
import itertools
import json
import mmap
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import ple
from demo import disk_read_bytes, make_requests
from make_table import PREFIX, ensure_table
from ple.safetensors_header import read_header

PAGE = mmap.PAGESIZE
MiB = 2**20
CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_MEMORY = CGROUP_ROOT / "memory"

DEFAULTS = dict(table_gib=8.0, calls=16, rows=18000, windows="64,1024,4096,16384",
                ceiling="32,64")
QUICK = dict(table_gib=0.25, calls=4, rows=4000, windows="64,4096", ceiling="32")


# --------------------------------------------------------------------------- table layout

class Layout:
    """Where each row lies: the table's files and each shard's file and offset,
    read from the safetensors headers (the same files and order as ple.Table)."""

    def __init__(self, directory: Path, row_bytes: int):
        self.paths = sorted(directory.glob("*.safetensors"))
        shards = {}
        for index, path in enumerate(self.paths):
            for name, entry in read_header(path).items():
                if name.startswith(f"{PREFIX}.shard_") and name.endswith(".weight"):
                    shards[int(name[len(PREFIX) + 7:-7])] = (index, entry)
        ordered = [shards[i] for i in range(len(shards))]
        self.shard_file = np.array([f for f, _ in ordered], dtype=np.int64)
        self.shard_offset = np.array([e.offset for _, e in ordered], dtype=np.int64)
        self.shard_rows = [e.shape[0] for _, e in ordered]
        self.shard_starts = np.cumsum([0] + self.shard_rows)
        self.num_rows = int(self.shard_starts[-1])
        self.row_bytes = row_bytes
        if any(e.shape[1] != row_bytes for _, e in ordered):
            raise ValueError(f"{directory}: rows are not {row_bytes} B")

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, file index, byte offset in the file) of each id."""
        shard = np.searchsorted(self.shard_starts, ids, side="right") - 1
        local = ids - self.shard_starts[shard]
        return shard, self.shard_file[shard], self.shard_offset[shard] + local * self.row_bytes

    def pages(self, ids: np.ndarray) -> np.ndarray:
        """The distinct 4 KiB pages under the rows, as sorted keys file << 40 | page."""
        _, file, offset = self.locate(ids)
        first, last = offset // PAGE, (offset + self.row_bytes - 1) // PAGE
        keys = [(file << 40) | first]
        span = int((last - first).max(initial=0))
        keys += [(file << 40) | np.minimum(first + k, last) for k in range(1, span + 1)]
        return np.unique(np.concatenate(keys))


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


# --------------------------------------------------------------------------- arms

def arm_kind(arm: str) -> tuple[str, int | None]:
    kind, _, value = arm.partition(":")
    return kind, int(value) if value else None


def new_record(arm: str, state: str) -> dict:
    return {"arm": arm, "state": state, "calls": []}


def run_gather_arm(table: ple.Table, layout: Layout, arm: str, requests, state: str,
                   drop: str, threads: int | None) -> dict:
    table.config = ple.GatherConfig.from_spec(arm, **({"threads": threads} if threads else {}))
    out = torch.empty((len(requests[0]), layout.row_bytes), dtype=torch.uint8)
    out.fill_(0)  # fault the output buffer in outside the timed calls
    record = new_record(arm, state)
    if state == "warm":  # untimed pass: every page this arm asks for is resident after it
        for ids in requests:
            table.gather_bytes(ids, out=out)
    elif drop == "arm":
        drop_table(table, layout)
    digest = hashlib.sha256()
    for ids in requests:
        if state == "cold" and drop == "call":
            drop_table(table, layout)
        before, read0 = table.stats(), disk_read_bytes()
        start = time.perf_counter()
        table.gather_bytes(ids, out=out)
        seconds = time.perf_counter() - start
        read, after = disk_read_bytes() - read0, table.stats()
        delta = {k: after[k] - before[k] for k in after}
        record["calls"].append({
            "ms": seconds * 1e3, "read_bytes": read, "unique_pages": delta["unique_pages"],
            "resident_pages": delta["resident_pages"], "major_faults": delta["major_faults"],
            "advised_pages": delta["advised_pages"],
            "evicted_before_copy": delta["evicted_before_copy"],
            "max_advised_ahead_bytes": after["max_advised_ahead_bytes"]})
        digest.update(out.numpy().data)
    record["sha256"] = digest.hexdigest()
    return record


def drop_table(table: ple.Table | None, layout: Layout) -> None:
    """Unmaps the table's pages (madvise DONTNEED) and drops them from the page cache."""
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
        start = time.perf_counter()
        gather(ids, out)
        seconds = time.perf_counter() - start
        record["calls"].append({
            "ms": seconds * 1e3, "read_bytes": disk_read_bytes() - read0,
            "unique_pages": len(layout.pages(ids)), "major_faults": major_faults() - faults0,
            "advised_pages": 0, "evicted_before_copy": 0})
        digest.update(out.data)
    record["sha256"] = digest.hexdigest()
    del maps, gather  # unmap before anything drops the page cache again
    gc.collect()
    return record


class ThreadReader:
    """Reads with a pool of DEPTH threads, each with its own page-aligned
    buffer, that take the next read and preadv it: DEPTH reads in flight while
    Python keeps up (on 2 cores it tops out near 40k reads/s, CPU bound)."""

    def __init__(self, depth: int, max_bytes: int):
        self.depth = depth
        self.buffers = [mmap.mmap(-1, max_bytes) for _ in range(depth)]  # page aligned
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=depth)

    def read(self, reads: list[tuple[int, int, int]]) -> int:
        counter = itertools.count()

        def worker(k: int) -> int:
            view, done = memoryview(self.buffers[k]), 0
            while (i := next(counter)) < len(reads):
                fd, offset, length = reads[i]
                done += os.preadv(fd, [view[:length]], offset)
            return done

        return sum(f.result() for f in [self.executor.submit(worker, k)
                                        for k in range(self.depth)])

    def close(self) -> None:
        self.executor.shutdown()
        for b in self.buffers:
            b.close()


class AioReader:
    """Reads with Linux native AIO (io_submit/io_getevents, as fio's libaio
    engine) from one thread that keeps exactly DEPTH reads in flight, each
    into its own page-aligned buffer.  Little CPU per read, so the disk, not
    Python, sets the pace."""

    SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}

    class Iocb(ctypes.Structure):  # struct iocb, little-endian layout
        _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32),
                    ("rw_flags", ctypes.c_int32), ("opcode", ctypes.c_uint16),
                    ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                    ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64),
                    ("offset", ctypes.c_int64), ("reserved2", ctypes.c_uint64),
                    ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]

    class Event(ctypes.Structure):  # struct io_event
        _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                    ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]

    def __init__(self, depth: int, max_bytes: int):
        numbers = self.SYSCALLS.get(platform.machine())
        if numbers is None or sys.byteorder != "little":
            raise OSError(f"no native AIO support here for {platform.machine()}")
        self.setup, self.destroy, self.getevents, self.submit = numbers
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long
        self.depth = depth
        self.ctx = ctypes.c_ulong(0)
        self._call(self.setup, depth, ctypes.byref(self.ctx))
        self.buffers = [mmap.mmap(-1, max_bytes) for _ in range(depth)]  # page aligned
        self.addresses = [ctypes.addressof(ctypes.c_char.from_buffer(b)) for b in self.buffers]
        self.iocbs = (self.Iocb * depth)()
        self.slot_ptrs = [ctypes.pointer(self.iocbs[i]) for i in range(depth)]
        self.batch = (ctypes.POINTER(self.Iocb) * depth)()
        self.events = (self.Event * depth)()

    def _call(self, number: int, *args) -> int:
        while True:
            result = self.libc.syscall(number, *args)
            if result >= 0:
                return result
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, f"AIO syscall {number}: {os.strerror(code)}")

    def read(self, reads: list[tuple[int, int, int]]) -> int:
        free, following, completed, total = list(range(self.depth)), 0, 0, 0
        while completed < len(reads):
            count = 0
            while free and following < len(reads):
                slot = free.pop()
                fd, offset, length = reads[following]
                cb = self.iocbs[slot]
                cb.data, cb.opcode, cb.fildes = slot, 0, fd  # 0: IOCB_CMD_PREAD
                cb.buf, cb.nbytes, cb.offset = self.addresses[slot], length, offset
                self.batch[count] = self.slot_ptrs[slot]
                count += 1
                following += 1
            done = 0
            while done < count:  # io_submit may take fewer than offered
                ptrs = ctypes.cast(ctypes.addressof(self.batch) + done * ctypes.sizeof(
                    ctypes.c_void_p), ctypes.POINTER(ctypes.POINTER(self.Iocb)))
                done += self._call(self.submit, self.ctx, count - done, ptrs)
            got = self._call(self.getevents, self.ctx, 1, self.depth, self.events, None)
            for event in self.events[:got]:
                if event.res < 0:
                    raise OSError(-event.res, f"AIO read: {os.strerror(-event.res)}")
                total += event.res
                free.append(event.data)
            completed += got
        return total

    def close(self) -> None:
        self._call(self.destroy, self.ctx)
        self.iocbs = self.batch = None
        for b in self.buffers:
            try:
                b.close()
            except BufferError:  # a ctypes view still holds it; freed with the reader
                pass


def direct_reads(layout: Layout, fds: list[int], ids: np.ndarray, max_pages: int):
    """The unique pages under the rows as (fd, offset, length) reads; adjacent
    pages of one file (rare in random rows) become one read of at most
    max_pages.  Returns (reads, number of pages)."""
    keys = layout.pages(ids)
    file, page = keys >> 40, keys & ((1 << 40) - 1)
    breaks = np.flatnonzero((np.diff(file) != 0) | (np.diff(page) != 1)) + 1
    reads = []
    for chunk in np.split(np.arange(len(keys)), breaks):
        for i in range(0, len(chunk), max_pages):
            part = chunk[i:i + max_pages]
            reads.append((fds[file[part[0]]], int(page[part[0]]) * PAGE, len(part) * PAGE))
    return reads, len(keys)


def run_ceiling_arm(layout: Layout, arm: str, requests, drop: str, engine: str) -> dict:
    """Reads each call's unique pages with O_DIRECT (no page cache, no mmap) at
    queue depth DEPTH, with `engine` ("aio" or "threads"); only the reads are
    timed.  Produces no rows."""
    _, depth = arm_kind(arm)
    record = new_record(arm, "cold")
    try:
        fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in layout.paths]
    except OSError as error:
        raise RuntimeError(f"O_DIRECT open failed ({error}); this filesystem cannot "
                           "serve the ceiling arm") from None
    max_pages = 32
    reader = None
    try:
        if engine == "aio":
            try:
                reader = AioReader(depth, max_pages * PAGE)
            except OSError as error:
                print(f"  native AIO unavailable ({error}); {arm} uses a thread pool",
                      file=sys.stderr)
                engine = "threads"
        if reader is None:
            reader = ThreadReader(depth, max_pages * PAGE)
        record["engine"] = engine
        if drop == "arm":
            drop_files(layout.paths)
        for ids in requests:
            reads, pages = direct_reads(layout, fds, ids.numpy(), max_pages)
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
            threads: int | None, engine: str, table: ple.Table | None = None) -> dict:
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
        return run_gather_arm(table, layout, arm, requests, state, drop, threads)
    with ple.Table.from_safetensors(table_dir, PREFIX) as own:
        return run_gather_arm(own, layout, arm, requests, state, drop, threads)


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


def summarize(record: dict, rows: int, new_pages: list[int]) -> dict:
    calls = record.pop("calls")
    if record["state"] == "cold":
        for call, new in zip(calls, new_pages):
            call["new_pages"] = new
    n = len(calls)
    ms = [c["ms"] for c in calls]

    def mean(key):
        values = [c[key] for c in calls if c.get(key) is not None]
        return sum(values) / len(values) if values else None

    unique = mean("unique_pages")
    read = mean("read_bytes")
    record.update({
        "ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
        "rows_per_s": rows * n / (sum(ms) / 1e3),
        "unique_pages_per_call": unique,
        "unique_bytes_per_call": unique * PAGE,
        "new_pages_per_call": mean("new_pages"),
        "read_bytes_per_call": read,
        "read_over_unique": read / (unique * PAGE) if unique else None,
        "major_faults_per_call": mean("major_faults"),
        "advised_pages_per_call": mean("advised_pages"),
        "evicted_before_copy_per_call": mean("evicted_before_copy"),
        "resident_pages_per_call": mean("resident_pages"),
        "per_call": calls,
    })
    return record


# --------------------------------------------------------------------------- cgroups

class CgroupError(RuntimeError):
    pass


def own_cgroup(version: int) -> str:
    """This process's cgroup path (v2), or its memory cgroup path (v1)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (version == 2 and controllers == "") or (
                    version == 1 and "memory" in controllers.split(",")):
                return path
    return "/"


class MemoryCgroup:
    """A memory cgroup this tool creates for one arm's child, and removes.

    cgroup v2 (/sys/fs/cgroup/cgroup.controllers exists): a group under the
    root of the hierarchy with memory.high = limit (reclaim and throttle above
    it, as in the seed's setup) and memory.max = limit + 1/8 (the OOM line).
    cgroup v1: a group nested in this process's memory cgroup under
    /sys/fs/cgroup/memory/ with memory.limit_in_bytes = limit."""

    def __init__(self, name: str, limit_mib: int):
        self.version = 2 if (CGROUP_ROOT / "cgroup.controllers").exists() else 1
        if self.version == 2:
            base = CGROUP_ROOT
        else:
            if not (V1_MEMORY / "memory.limit_in_bytes").exists():
                raise CgroupError(f"no cgroup v2 hierarchy at {CGROUP_ROOT} and no cgroup v1 "
                                  f"memory controller at {V1_MEMORY}")
            base = V1_MEMORY / own_cgroup(1).lstrip("/")
        self.path = base / name
        self.limit = limit_mib * MiB
        try:
            self.path.mkdir()
        except OSError as error:
            raise CgroupError(f"cannot create the memory cgroup {self.path}: {error}") from None
        try:
            if self.version == 2:
                if "memory" not in (self.path / "cgroup.controllers").read_text().split():
                    (base / "cgroup.subtree_control").write_text("+memory")
                self._write("memory.max", str(self.limit + self.limit // 8))
                self._write("memory.high", str(self.limit))
            else:
                self._write("memory.limit_in_bytes", str(self.limit))
        except OSError as error:
            self.remove()
            raise CgroupError(f"cannot set the memory limit of {self.path}: {error}") from None

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def stat(self) -> dict[str, int]:
        return {k: int(v) for k, v in (line.split() for line in self.read("memory.stat").splitlines())}

    def oom_kills(self) -> int:
        try:
            text = self.read("memory.events" if self.version == 2 else "memory.oom_control")
        except OSError:
            return 0
        return next((int(line.split()[1]) for line in text.splitlines()
                     if line.startswith("oom_kill ")), 0)

    def usage(self) -> int:
        return int(self.read("memory.current" if self.version == 2 else "memory.usage_in_bytes"))

    def peak(self) -> int | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(self.read(name))
        except OSError:
            return None

    def cache_and_anon(self) -> tuple[int, int]:
        stat = self.stat()
        if self.version == 2:
            return stat.get("file", 0), stat.get("anon", 0)
        return stat.get("cache", 0), stat.get("rss", 0)

    def enter(self) -> None:
        self._write("cgroup.procs", str(os.getpid()))

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # a child that just exited may still be listed
        print(f"warning: could not remove {self.path}", file=sys.stderr)

    @classmethod
    def attach(cls, path: str, version: int, limit: int) -> "MemoryCgroup":
        group = cls.__new__(cls)
        group.path, group.version, group.limit = Path(path), version, limit
        return group


def child_main(spec_json: str) -> None:
    """One arm in a child process: moves itself into the cgroup, touches the
    ballast, runs the arm, writes its result as JSON to the parent's pipe."""
    spec = json.loads(spec_json)
    layout = Layout(Path(spec["table"]), spec["row_bytes"])
    requests = make_requests(layout.num_rows, spec["calls"], spec["rows"], spec["seed"])
    table = None
    if arm_kind(spec["arm"])[0] not in ("ceiling", "numpy"):
        table = ple.Table.from_safetensors(spec["table"], PREFIX)  # maps, reads no rows
    group = MemoryCgroup.attach(spec["cgroup"], spec["cgroup_version"], spec["limit"])
    group.enter()  # from here on, this process's new memory is charged to the group
    # private anonymous memory, every page touched: with no swap, nothing reclaims it
    ballast = mmap.mmap(-1, max(spec["ballast"], 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    np.frombuffer(ballast, dtype=np.uint8)[::PAGE] = 1
    after_ballast, stat0 = group.usage(), group.stat()
    record = run_arm(Path(spec["table"]), layout, spec["arm"], requests, spec["state"],
                     spec["drop"], spec["threads"], spec["engine"], table)
    cache, anon = group.cache_and_anon()
    usage, stat1 = group.usage(), group.stat()
    refaults = "workingset_refault_file" if "workingset_refault_file" in stat1 else "workingset_refault"
    record["cgroup"] = {
        "version": group.version, "limit_bytes": group.limit, "ballast_bytes": spec["ballast"],
        "usage_after_ballast": after_ballast, "usage_end": usage, "peak": group.peak(),
        "cache_end": cache, "anon_end": anon,
        # file pages read again after the group's reclaim evicted them, during the arm
        "file_refaults": stat1.get(refaults, 0) - stat0.get(refaults, 0),
        # what the limit leaves for page cache once everything else is charged
        "cache_room_bytes": group.limit - (usage - cache)}
    if table is not None:
        table.close()
    with os.fdopen(spec["fd"], "w") as pipe:
        json.dump(record, pipe)


def run_arm_in_cgroup(args, arm: str, state: str, index: int, layout: Layout) -> dict:
    group = MemoryCgroup(f"ple-bench-{os.getpid()}-{index}", args.memory_limit)
    try:
        if state == "cold" and args.drop == "arm":
            drop_files(layout.paths)  # the parent maps nothing of the table
        read_fd, write_fd = os.pipe()
        spec = {"table": str(args.table), "row_bytes": args.row_bytes, "calls": args.calls,
                "rows": args.rows, "seed": args.seed, "arm": arm, "state": state,
                "drop": args.drop, "threads": args.threads, "engine": args.ceiling_engine,
                "cgroup": str(group.path), "cgroup_version": group.version, "limit": group.limit,
                "ballast": args.ballast * MiB, "fd": write_fd}
        child = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)],
                                 pass_fds=(write_fd,))
        os.close(write_fd)
        with os.fdopen(read_fd) as pipe:
            text = pipe.read()
        code = child.wait()
        if code != 0 or not text:
            kills = group.oom_kills()
            why = (f"the child was OOM-killed ({kills} OOM kill(s) in its cgroup): the limit "
                   f"of {args.memory_limit} MiB leaves too little beside {args.ballast} MiB "
                   "of ballast" if kills or code == -9 else f"the child exited with {code}")
            raise RuntimeError(why)
        return json.loads(text)
    finally:
        group.remove()


# --------------------------------------------------------------------------- report

def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_table(results: list[dict]) -> None:
    header = (f"{'arm':<14} {'state':<5} {'median ms':>10} {'min ms':>9} {'max ms':>9} "
              f"{'rows/s':>11} {'pages':>7} {'new':>7} {'read MiB':>9} {'read/uniq':>9} {'maj.flt':>8} "
              f"{'advised':>8} {'evicted':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['arm']:<14} {r['state']:<5} FAILED: {r['error']}")
            continue
        print(f"{r['arm']:<14} {r['state']:<5} {r['ms_median']:>10.2f} {r['ms_min']:>9.2f} "
              f"{r['ms_max']:>9.2f} {r['rows_per_s']:>11,.0f} "
              f"{r['unique_pages_per_call']:>7.0f} {fmt(r['new_pages_per_call'], '>7.0f')} "
              f"{r['read_bytes_per_call'] / MiB:>9.1f} "
              f"{fmt(r['read_over_unique'], '>8.2f')}x {fmt(r['major_faults_per_call'], '>8.0f')} "
              f"{fmt(r['advised_pages_per_call'], '>8.0f')} "
              f"{fmt(r['evicted_before_copy_per_call'], '>8.0f')}")


def goals(results: list[dict], pressure: bool) -> list[dict]:
    """The issue's goals, evaluated on these results (where the arms ran)."""
    ok = [r for r in results if "error" not in r]
    get = {(r["arm"], r["state"]): r for r in ok}
    found = []

    def goal(name, value, holds, detail):
        found.append({"goal": name, "value": value, "holds": holds, "detail": detail})

    ceilings = [r for r in ok if r["arm"].startswith("ceiling")]
    window, none = get.get(("window:4096", "cold")), get.get(("none", "cold"))
    if window and ceilings and not pressure:
        best = min(ceilings, key=lambda r: r["ms_median"])
        ratio = window["ms_median"] / best["ms_median"]
        goal("cold window:4096 within 1.15x of the ceiling", ratio, ratio <= 1.15,
             f"{window['ms_median']:.1f} ms against {best['arm']} {best['ms_median']:.1f} ms")
    if window and none and not pressure:
        ratio = none["ms_median"] / window["ms_median"]
        goal("cold window:4096 at least 6x faster than none", ratio, ratio >= 6,
             f"none {none['ms_median']:.1f} ms / window:4096 {window['ms_median']:.1f} ms")
    old = get.get(("all", "cold"))
    if pressure and old:
        for r in ok:
            if r["arm"].startswith("window:") and r["state"] == "cold":
                read, time_ratio = r["read_over_unique"], r["ms_median"] / old["ms_median"]
                goal(f"pressure {r['arm']} reads <= 1.1x the unique pages", read,
                     read <= 1.1, f"{r['read_bytes_per_call'] / MiB:.1f} MiB per call against "
                     f"{r['unique_bytes_per_call'] / MiB:.1f} MiB of unique pages")
                goal(f"pressure {r['arm']} takes <= 0.7x the time of all", time_ratio,
                     time_ratio <= 0.7, f"{r['ms_median']:.1f} ms against all "
                     f"{old['ms_median']:.1f} ms")
        goal("pressure all reads pages more than once", old["read_over_unique"],
             old["read_over_unique"] > 1.1,
             f"{old['read_bytes_per_call'] / MiB:.1f} MiB per call against "
             f"{old['unique_bytes_per_call'] / MiB:.1f} MiB of unique pages")
    numpy_arm, warm = get.get(("numpy", "warm")), get.get(("window:4096", "warm"))
    if numpy_arm and warm:
        ratio = numpy_arm["ms_median"] / warm["ms_median"]
        goal("warm window:4096 at least 2x faster than numpy", ratio, ratio >= 2,
             f"numpy {numpy_arm['ms_median']:.2f} ms / window:4096 {warm['ms_median']:.2f} ms")
    return found


def plot(results: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed, no plot", file=sys.stderr)
        return
    ok = [r for r in results if "error" not in r]
    labels = [f"{r['arm']}\n{r['state']}" for r in ok]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, len(ok) * 0.9), 8), sharex=True)
    for x, r in enumerate(ok):
        ms = [c["ms"] for c in r["per_call"]]
        top.scatter([x] * len(ms), ms, s=10, alpha=0.6)
        top.hlines(r["ms_median"], x - 0.3, x + 0.3, color="black")
    top.set_ylabel("ms per call (median: bar)")
    top.set_yscale("log")
    top.set_title(title)
    xs = range(len(ok))
    bottom.bar(xs, [r["read_bytes_per_call"] / MiB for r in ok], label="read from disk")
    bottom.scatter(xs, [r["unique_bytes_per_call"] / MiB for r in ok], color="red", marker="_",
                   s=400, label="unique pages")
    bottom.set_ylabel("MiB read per call")
    bottom.legend()
    bottom.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}", file=sys.stderr)


# --------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2] if __doc__.count("\n\n") >= 2 else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, default=Path("data/bench_table"),
                        help="the table's directory; written there unless it already holds "
                        "a table of this size (default data/bench_table)")
    parser.add_argument("--table-gib", type=float, help="table size (default 8; --quick 0.25)")
    parser.add_argument("--row-bytes", type=int, default=160, help="FP8 row size (default 160)")
    parser.add_argument("--calls", type=int, help="calls per arm (default 16; --quick 4)")
    parser.add_argument("--rows", type=int, help="random ids per call (default 18000; --quick 4000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the ids (default 0)")
    parser.add_argument("--windows", help="KiB budgets of the window:KiB arms, comma separated "
                        "(default 64,1024,4096,16384; --quick 64,4096)")
    parser.add_argument("--distance", type=int, default=4096,
                        help="KiB of the distance:KiB arm, the seed's window (default 4096; 0: no arm)")
    parser.add_argument("--ceiling", help="queue depths of the ceiling:DEPTH arms, comma "
                        "separated (default 32,64; --quick 32; empty: none)")
    parser.add_argument("--ceiling-engine", choices=("aio", "threads"), default="aio",
                        help="how the ceiling arms keep DEPTH O_DIRECT reads in flight: Linux "
                        "native AIO from one thread (default; falls back to threads where "
                        "unavailable), or a pool of DEPTH threads doing preadv (CPU bound near "
                        "40k reads/s on 2 cores)")
    parser.add_argument("--no-prime", dest="prime", action="store_false",
                        help="skip the pass that reads every call's pages once with O_DIRECT "
                        "before the arms (see above)")
    parser.add_argument("--threads", type=int, help="GatherConfig.threads (default: its default)")
    parser.add_argument("--drop", choices=("arm", "call"), default="arm",
                        help="cold runs drop the table's pages from the page cache (the tool's "
                        "table unmapped first, then posix_fadvise DONTNEED on each file) before "
                        "each arm (default, as the issue asks: every call draws distinct random "
                        "ids, so its pages are mostly cold: column 'new' counts the pages no "
                        "earlier call of the arm asked for) or before each call ('call': every "
                        "call fully cold)")
    parser.add_argument("--warm", action="store_true",
                        help="after the cold arms, run every gathering arm and numpy again "
                        "without dropping, each after one untimed pass over its calls")
    parser.add_argument("--memory-limit", type=int, metavar="MiB",
                        help="run each arm in its own child process in a memory cgroup of this "
                        "limit, which the tool creates and removes (needs root or a delegated "
                        "cgroup; exits non-zero without)")
    parser.add_argument("--ballast", type=int, default=0, metavar="MiB",
                        help="touched anonymous memory the child allocates inside the cgroup "
                        "before the arm (with --memory-limit; there is no swap to take it).  The "
                        "page tables of the mapped table are charged to the group as well (about "
                        "25 MiB for random rows over an 8 GiB table): the tool prints the page "
                        "cache room that is really left")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", type=Path, metavar="PATH",
                        help="write a PNG of time per call and bytes read per arm (needs matplotlib)")
    parser.add_argument("--quick", action="store_true",
                        help="a run of under a minute: 256 MiB table, 4 calls of 4000 rows, "
                        "windows 64 and 4096, ceiling:32 only (explicit flags still win)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.ballast and args.memory_limit is None:
        parser.error("--ballast needs --memory-limit")
    if args.memory_limit is not None and args.ballast >= args.memory_limit:
        parser.error("--ballast must be less than --memory-limit")
    return args


def arm_list(args) -> list[str]:
    arms = ["none", "all"]
    if args.distance:
        arms.append(f"distance:{args.distance}")
    arms += [f"window:{int(w)}" for w in args.windows.split(",") if w.strip()]
    return arms


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    pressure = args.memory_limit is not None
    if pressure:  # fail early and clearly without the rights to make a cgroup
        try:
            MemoryCgroup(f"ple-bench-{os.getpid()}-probe", args.memory_limit).remove()
        except CgroupError as error:
            hint = ("this process is root: is the cgroup filesystem read-only here, as in "
                    "many containers?" if os.geteuid() == 0 else "run as root, or inside a "
                    "cgroup v2 subtree delegated to this user")
            print(f"error: --memory-limit needs a memory cgroup that this tool creates, and it "
                  f"cannot: {error}; {hint}", file=sys.stderr)
            return 2

    num_rows = int(args.table_gib * 2**30) // args.row_bytes
    ensure_table(args.table, rows=num_rows, row_bytes=args.row_bytes)
    layout = Layout(args.table, args.row_bytes)
    requests = make_requests(num_rows, args.calls, args.rows, args.seed)
    gathering = arm_list(args)
    ceilings = [f"ceiling:{int(d)}" for d in (args.ceiling or "").split(",") if d.strip()]
    plan = [(arm, "cold") for arm in gathering + ceilings]
    if args.prime:
        plan.insert(0, (f"prime:{ceilings[0].partition(':')[2] if ceilings else 32}", "cold"))
    new_pages = new_pages_per_call(layout, requests, args.drop)
    if args.warm:
        plan += [(arm, "warm") for arm in gathering + ["numpy"]]

    setup = (f"{layout.num_rows:,} rows of {args.row_bytes} B "
             f"({layout.num_rows * args.row_bytes / 2**30:.2f} GiB) in {len(layout.shard_rows)} "
             f"shards over {len(layout.paths)} files; {args.calls} calls of {args.rows:,} random "
             f"ids per arm (seed {args.seed}); cold = page cache dropped before each {args.drop}")
    if pressure:
        setup += (f"; each arm in a child in a memory cgroup of {args.memory_limit} MiB with "
                  f"{args.ballast} MiB of touched ballast")
    print(setup, file=sys.stderr)

    results: list[dict] = []
    table = None
    if not pressure:
        table = ple.Table.from_safetensors(args.table, PREFIX)
    try:
        for index, (arm, state) in enumerate(plan):
            print(f"  {arm} {state} ...", file=sys.stderr, flush=True)
            try:
                if arm.startswith("prime:"):
                    record = run_ceiling_arm(layout, arm, requests, "arm", args.ceiling_engine)
                elif pressure:
                    record = run_arm_in_cgroup(args, arm, state, index, layout)
                else:
                    record = run_arm(args.table, layout, arm, requests, state, args.drop,
                                     args.threads, args.ceiling_engine, table)
                results.append(summarize(record, args.rows, new_pages))
            except (RuntimeError, OSError) as error:
                print(f"  {arm} {state} failed: {error}", file=sys.stderr)
                results.append({"arm": arm, "state": state, "error": str(error)})
    finally:
        if table is not None:
            table.close()

    print()
    print(setup)
    if pressure:
        for label, keep in (("gathering arms", True), ("ceiling arms", False)):
            rooms = [r["cgroup"] for r in results if "cgroup" in r and bool(r.get("sha256")) == keep]
            if rooms:
                room = [g["cache_room_bytes"] / MiB for g in rooms]
                other = [(g["usage_end"] - g["cache_end"] - g["anon_end"]) / MiB for g in rooms]
                print(f"{label}: page cache room left by the limit (limit - non-cache usage at "
                      f"the end of the arm) {min(room):.1f} to {max(room):.1f} MiB; kernel "
                      f"memory charged (page tables, slab) {min(other):.1f} to {max(other):.1f} MiB")
    print_table(results)

    digests = {r["sha256"] for r in results if r.get("sha256")}
    failed = [r for r in results if "error" in r]
    print()
    if len(digests) == 1:
        print(f"every gathering arm returned the same bytes (sha256 {next(iter(digests))})")
    elif digests:
        print("FAIL: gathering arms returned different bytes:")
        for r in results:
            if r.get("sha256"):
                print(f"  {r['arm']:<14} {r['state']:<5} {r['sha256']}")
    cold_reads = [r for r in results if r.get("state") == "cold" and "error" not in r]
    if cold_reads and all(r["read_bytes_per_call"] == 0 for r in cold_reads):
        print("note: the cold arms read nothing from disk: the page cache could not be dropped "
              "(a tmpfs, or an overlay without a block device?)")

    found = goals(results, pressure)
    if found:
        print("\ngoals of the issue:")
        for g in found:
            print(f"  {'holds' if g['holds'] else 'FAILS':<5}  {g['goal']}: {g['value']:.2f}x "
                  f"({g['detail']})")

    if args.json:
        document = {
            "setup": setup, "args": {k: (str(v) if isinstance(v, Path) else v)
                                     for k, v in vars(args).items() if k != "child"},
            "table": {"num_rows": layout.num_rows, "row_bytes": args.row_bytes,
                      "files": [str(p) for p in layout.paths], "shard_rows": layout.shard_rows},
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                        "torch": torch.__version__},
            "arms": results, "goals": found,
            "sha256_equal": len(digests) == 1, "failed_arms": [r["arm"] for r in failed]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1))
        print(f"\nresults written to {args.json}")
    if args.plot:
        plot(results, args.plot, setup.split(";")[0])
    if failed:
        print(f"FAIL: {len(failed)} arm(s) failed", file=sys.stderr)
        return 1
    return 0 if len(digests) <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
