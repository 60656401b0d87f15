"""O_DIRECT reads of a set of file pages with a fixed number in flight: what
the disk serves for an access pattern, without page cache or mmap (the
ceiling the gather benchmark compares the gather with).

Two engines: Linux native AIO (io_submit/io_getevents from one thread, as
fio's libaio engine; little CPU per read) and a pool of threads doing preadv
(CPU bound near 40k reads/s on 2 cores).  Each read lands in a page-aligned
buffer of its own, as O_DIRECT requires.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import itertools
import mmap
import os
import platform
import sys

import numpy as np

PAGE = mmap.PAGESIZE


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


def page_reads(keys: np.ndarray, fds: list[int], max_pages: int) -> list[tuple[int, int, int]]:
    """Reads of the pages ``keys`` (sorted keys file << 40 | page, as
    Layout.pages gives them) as (fd, offset, length), ``fds[file]`` being
    each file's O_DIRECT descriptor; adjacent pages of one file (rare in
    random rows) become one read of at most ``max_pages``."""
    file, page = keys >> 40, keys & ((1 << 40) - 1)
    breaks = np.flatnonzero((np.diff(file) != 0) | (np.diff(page) != 1)) + 1
    reads = []
    for chunk in np.split(np.arange(len(keys)), breaks):
        for i in range(0, len(chunk), max_pages):
            part = chunk[i:i + max_pages]
            reads.append((fds[file[part[0]]], int(page[part[0]]) * PAGE, len(part) * PAGE))
    return reads


def open_direct(paths) -> list[int]:
    """Each file opened with O_DIRECT (no page cache); a RuntimeError that says
    so where the filesystem refuses it (tmpfs, some overlays)."""
    fds = []
    try:
        for path in paths:
            fds.append(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError as error:
        for fd in fds:
            os.close(fd)
        raise RuntimeError(f"O_DIRECT open failed ({error}); this filesystem cannot serve "
                           "direct reads") from None
    return fds


def open_reader(engine: str, depth: int, max_bytes: int) -> tuple[ThreadReader | AioReader, str]:
    """A reader of ``engine`` ("aio" or "threads") keeping ``depth`` reads of
    at most ``max_bytes`` in flight, and the engine it really is: "aio" falls
    back to threads, and says so, where native AIO is unavailable."""
    if engine == "aio":
        try:
            return AioReader(depth, max_bytes), "aio"
        except OSError as error:
            print(f"  native AIO unavailable ({error}); using a pool of {depth} threads",
                  file=sys.stderr)
    return ThreadReader(depth, max_bytes), "threads"
