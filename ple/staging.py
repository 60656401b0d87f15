"""Pinned host buffers through which the CUDA operator moves rows: the ids
(device to host) and the gathered rows (host to device), one set per table,
device and stream."""

from __future__ import annotations

import atexit
import mmap
import weakref

import numpy as np
import torch

from .kernels.native import native

PAGE = mmap.PAGESIZE


class PinnedBuffer:
    """Page-locked host memory of the size asked for, rounded up to a page.

    torch's pinned allocator rounds every block up to a power of two (1 GiB +
    1 MiB takes 2 GiB), so the memory is mapped here and page-locked by the
    native part (which may do so while a CUDA graph is being captured);
    copies from it run at pinned speed and kernels can read it over UVA.
    A buffer dropped without ``free()`` is unlocked before its memory is
    unmapped: memory unmapped while registered stays registered with the
    driver, and a later mapping at that address cannot be page-locked
    (CUresult 712).
    """

    def __init__(self, nbytes: int):
        self._map = mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE))
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        # A thread with no CUDA context yet borrows this device's.
        self.device = torch.cuda.current_device()
        native.register_host_memory(self.bytes.data_ptr(), self.bytes.numel(), self.device)
        # Weak references are cleared, and this runs, before the buffer's
        # attributes (the mapping) are released.
        self._unregister = weakref.finalize(self, native.unregister_host_memory,
                                            self.bytes.data_ptr(), self.device)
        self._unregister.atexit = False  # the process's exit unmaps and unlocks everything
        self.captured = False  # used by a CUDA graph: lives until the table closes

    @property
    def nbytes(self) -> int:
        return self.bytes.numel()

    def free(self) -> None:
        if self.bytes is not None:
            self._unregister()
            self.bytes = None


# The CUDA devices whose streams have staged rows in this process.
_devices: set[int] = set()


def _finish_at_exit() -> None:
    """Waits, at the interpreter's exit, for the work of every device that
    staged rows: a host gather still enqueued (an eager call's, or a CUDA
    graph's replay still running) reads the pinned ids and writes the pinned
    rows, whose memory Python unmaps when it tears its modules down, after
    this.  Every gather of ple ends (a graph's ring is always answered);
    a forked child, whose CUDA is the parent's, waits for nothing."""
    if native.forked_after_cuda() or getattr(torch.cuda, "_is_in_bad_fork", bool)():
        return
    for device in _devices:
        try:
            torch.cuda.synchronize(device)
        except Exception:  # the device is gone: nothing of it runs any longer
            pass


class StreamStaging:
    """The buffers of one table on one stream.  Work on a stream runs in
    order, so a call may reuse the buffers of the call before it; a larger
    request replaces them, and the old ones are freed once the stream has
    passed the point where they were replaced (never, for buffers a graph
    captured: those live until the table closes)."""

    def __init__(self, stream: torch.cuda.Stream, row_bytes: int,
                 bad_id_flag: PinnedBuffer | None = None):
        self.stream = stream
        self.row_bytes = row_bytes
        if not _devices:
            atexit.register(_finish_at_exit)  # after torch's: it runs before them
        _devices.add(stream.device.index)
        self.capacity = 0  # rows
        self.ids: PinnedBuffer | None = None
        self.rows: PinnedBuffer | None = None
        self.status = PinnedBuffer(4)
        self.status_word = self.status.bytes[:4].view(torch.int32)
        # Set by a call whose rows were all resident (no host gather checked
        # its ids) when an id was out of range; a graph's buffers share their
        # stream's, so that the next eager call there raises.
        self._owns_flag = bad_id_flag is None
        self.bad_id_flag = PinnedBuffer(4) if bad_id_flag is None else bad_id_flag
        # The int32 that a kernel sets, and the host's view of it: read every
        # call, so a NumPy view (a tensor's .item() costs microseconds).
        self.bad_id_word = self.bad_id_flag.bytes[:4].view(torch.int32)
        self._bad_id_seen = self.bad_id_flag.bytes[:4].numpy().view(np.int32)
        self._retired: list[tuple[torch.cuda.Event | None, PinnedBuffer]] = []
        # The views of the buffers for the last request size and their
        # addresses, (n, ids, rows, ids' address, rows' address): None until
        # a request, and after the buffers change.
        self._views: tuple[int, torch.Tensor, torch.Tensor, int, int] | None = None

    def reserve(self, n: int, capturing: bool) -> None:
        """Makes room for n rows (and marks the buffers captured when they
        are about to be used in a graph)."""
        self._free_retired(capturing)
        if n > self.capacity:
            old = [b for b in (self.ids, self.rows) if b is not None]
            if old:
                event = None if capturing else torch.cuda.Event()
                if event is not None:
                    event.record(self.stream)
                self._retired += [(event, b) for b in old]
            self.ids = PinnedBuffer(8 * n)
            self.rows = PinnedBuffer(self.row_bytes * n)
            self.capacity = n
            self._views = None
        if capturing:  # only ids and rows are ever replaced (and retired)
            self.ids.captured = self.rows.captured = True

    def gather(self, native_handle: int, ids: torch.Tensor, resident_range: tuple[int, int],
               capturing: bool, owner: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Enqueues on this stream the gather of ``ids`` (CUDA, any shape):
        the ids are copied into the pinned ids buffer, then the native gather
        runs as a host function and fills the pinned rows buffer, skipping
        the ids of ``resident_range``, for prefetch owner ``owner`` (whose
        plan advances when the gather runs).  Returns the staged rows
        ``[n, row_bytes]`` and the status word the host function sets when
        it fails; both are valid in stream order only."""
        n = ids.numel()
        self.reserve(n, capturing)
        if self._views is None or self._views[0] != n:
            staged_ids = self.ids.bytes[: 8 * n].view(torch.int64)
            rows = self.rows.bytes[: n * self.row_bytes].view(n, self.row_bytes)
            self._views = (n, staged_ids, rows, staged_ids.data_ptr(), rows.data_ptr())
        _, staged_ids, rows, ids_address, rows_address = self._views
        staged_ids.copy_(ids.reshape(-1).to(torch.int64), non_blocking=True)
        native.launch_host_gather(self.stream.cuda_stream, native_handle, ids_address, n,
                                  *resident_range, rows_address, self.status_word.data_ptr(),
                                  capturing, owner)
        return rows, self.status_word

    def take_bad_id_flag(self) -> bool:
        """Whether an earlier call found a bad id on the device; clears it."""
        if self._bad_id_seen[0] == 0:
            return False
        self._bad_id_seen[0] = 0
        return True

    def _free_retired(self, capturing: bool) -> None:
        if capturing:
            return  # an event cannot be queried while a stream captures
        keep = []
        for event, buffer in self._retired:
            if buffer.captured or event is None or not event.query():
                keep.append((event, buffer))
            else:
                buffer.free()
        self._retired = keep

    def nbytes(self) -> int:
        flag = self.bad_id_flag if self._owns_flag else None
        live = [b for b in (self.ids, self.rows, self.status, flag) if b is not None]
        return sum(b.nbytes for b in live) + sum(b.nbytes for _, b in self._retired)

    def free(self) -> None:
        """Frees every buffer; the caller has synchronized the stream."""
        for buffer in (self.ids, self.rows, self.status, self.bad_id_flag,
                       *(b for _, b in self._retired)):
            if buffer is not None:
                buffer.free()
        self.ids = self.rows = self.status = self.bad_id_flag = None
        self.status_word = self.bad_id_word = self._bad_id_seen = self._views = None
        self._retired = []
        self.capacity = 0
