"""A table's tiers: a run of its rows kept in device and host memory.

``Table.place(device_rows, host_rows, device, first_row=f)`` makes a
table's ``Tiers`` (``table.tiers``): rows ``[f, f + device_rows)`` on a GPU
(the device tier) and the next ``host_rows`` rows in host memory (the host
tier; page-locked when CUDA is there, so that kernels read it over UVA).
Rows are kept as the bytes of the file, packed as on disk; only the rows a
call gathers are decoded.  The rows the tiers hold are the resident rows,
``resident_range``: the native gather skips them, and the operator reads
them from here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from .staging import PinnedBuffer

# Rows are read into the tiers this many bytes at a time, so that placing a
# large device tier never holds more than this in host memory.
LOAD_CHUNK_BYTES = 64 << 20


class Tiers:
    """The device and host tiers of one table.

    Attributes:
        first_row: the first resident row.
        device_rows, host_rows: the rows of each tier (the device tier's
            first).
        device: the GPU of the device tier (None without one).
        device_table, host_table: uint8 ``[rows, row_bytes]``, each tier's
            rows as in the files (None for a tier of no rows).
        row_bytes: bytes of a row.
        captured: whether a CUDA graph reads the tiers (then they live until
            the table closes).
        calls, retired: the gathers reading the tiers now, and whether a
            ``place`` or ``close`` replaced them (``Table.acquire``).
    """

    def __init__(self, read_rows: Callable[[torch.Tensor, torch.Tensor], None], row_bytes: int,
                 device_rows: int, host_rows: int, device: torch.device | None,
                 first_row: int = 0, progress: Callable[[int, int], None] | None = None):
        self.first_row = first_row
        self.row_bytes = row_bytes
        self.device_rows = device_rows
        self.host_rows = host_rows
        self.device = device
        self.device_table: torch.Tensor | None = None
        self._pinned: PinnedBuffer | None = None
        self.host_table: torch.Tensor | None = None
        self._cpu_hits = [0, 0]  # device, host: rows CPU gathers took from the tiers
        self._cpu_hits_lock = threading.Lock()
        # Made now for the devices in use, not at the first CUDA gather there:
        # a tensor first allocated while torch.compile records a CUDA graph
        # would belong to the graph's pool.  (Not on every GPU: that would
        # start a context on devices this process does not use.)
        self._device_hits: dict[torch.device, torch.Tensor] = {}
        if torch.cuda.is_available():
            for in_use in {device, torch.device("cuda", torch.cuda.current_device())} - {None}:
                self.hits_on(in_use)
        self.captured = False  # a CUDA graph reads the tiers: they live until the table closes
        # Kept by the table under its lock: the calls reading these tiers now,
        # and whether the table still serves from them.
        self.calls = 0
        self.retired = False
        try:
            self._load(read_rows, progress)
        except BaseException:
            self.free()  # a half-placed tier must not stay page-locked
            raise

    def _load(self, read_rows: Callable[[torch.Tensor, torch.Tensor], None],
              progress: Callable[[int, int], None] | None) -> None:
        """Reads the tiers' rows, LOAD_CHUNK_BYTES at a time; device rows go
        through a host buffer of that size."""
        total = self.device_rows + self.host_rows
        chunk_rows = max(1, LOAD_CHUNK_BYTES // self.row_bytes)

        def read(first: int, out: torch.Tensor) -> None:  # tier rows [first, first + len(out))
            begin = self.first_row + first
            read_rows(torch.arange(begin, begin + out.shape[0], dtype=torch.int64), out)
            if progress is not None:
                progress(first + out.shape[0], total)

        if self.device_rows:
            self.device_table = torch.empty((self.device_rows, self.row_bytes), dtype=torch.uint8,
                                            device=self.device)
            staging = torch.empty((min(chunk_rows, self.device_rows), self.row_bytes), dtype=torch.uint8)
            for first in range(0, self.device_rows, chunk_rows):
                rows = staging[: min(chunk_rows, self.device_rows - first)]
                read(first, rows)
                self.device_table[first:first + rows.shape[0]].copy_(rows)
        if self.host_rows:
            if torch.cuda.is_available():
                self._pinned = PinnedBuffer(self.host_rows * self.row_bytes)
                flat = self._pinned.bytes[: self.host_rows * self.row_bytes]
            else:
                flat = torch.empty(self.host_rows * self.row_bytes, dtype=torch.uint8)
            self.host_table = flat.view(self.host_rows, self.row_bytes)
            for first in range(0, self.host_rows, chunk_rows):
                read(self.device_rows + first, self.host_table[first:first + chunk_rows])

    @property
    def resident_range(self) -> tuple[int, int]:
        """``(begin, end)``: the rows the tiers hold."""
        return self.first_row, self.first_row + self.device_rows + self.host_rows

    def fill_cpu(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Writes the resident rows of ``ids`` (valid, 1-D, CPU) into ``out``
        ``[n, row_bytes]``, where the native gather left them."""
        rows = ids.to(torch.int64) - self.first_row  # row in the tiers
        on_device = (rows >= 0) & (rows < self.device_rows)
        on_host = (rows >= self.device_rows) & (rows < self.device_rows + self.host_rows)
        device_hits = int(on_device.sum())
        host_hits = int(on_host.sum())
        if host_hits:
            out[on_host] = self.host_table[rows[on_host] - self.device_rows]
        if device_hits:
            out[on_device] = self.device_table[rows[on_device].to(self.device)].cpu()
        with self._cpu_hits_lock:
            self._cpu_hits[0] += device_hits
            self._cpu_hits[1] += host_hits

    def check_device(self, device: torch.device, table_name: str) -> None:
        """Raises unless CUDA ids on ``device`` can read these tiers."""
        if self.device_rows and self.device != device:
            # Another GPU's memory is not readable here without peer access.
            raise ValueError(f"ple.disk_gather: table {table_name!r} keeps its device tier on "
                             f"{self.device}, and the ids are on {device}")

    def read(self, ids: torch.Tensor, num_rows: int, status: torch.Tensor | None,
             report: torch.Tensor | None, capturing: bool):
        """How a decoder reads the rows of the CUDA ids ``ids`` from the tiers
        (a ``tier_rows_triton.TierRead``), and the status word it reads.
        ``status``: the host gather's, which staged the other rows; None when
        every row is resident, and then ``report`` is given: an id outside
        ``[0, num_rows)`` sets it, and the whole call is NaN."""
        from .kernels.tier_rows_triton import TierRead, check_ids  # needs triton: CUDA only

        self.captured |= capturing
        if ids.dim() != 1 or not ids.is_contiguous():
            ids = ids.reshape(-1).contiguous()  # the kernels index the ids as a dense vector
        tier_read = TierRead(ids, self.device_table, self.host_table, self.first_row, num_rows,
                             self.hits_on(ids.device), report)
        if report is not None and not tier_read.scan_ids:
            status = check_ids(ids, num_rows, report)  # too many ids for every program to check
        return tier_read, status

    def hits_on(self, device: torch.device) -> torch.Tensor:
        """int64 [device, host] counters that CUDA gathers on ``device`` add to."""
        hits = self._device_hits.get(device)
        if hits is None:
            hits = self._device_hits[device] = torch.zeros(2, dtype=torch.int64, device=device)
        return hits

    def hits(self) -> tuple[int, int]:
        """Rows served by the device and the host tier, every device together."""
        device_hits, host_hits = self._cpu_hits
        for counters in self._device_hits.values():
            on_device, on_host = counters.tolist()
            device_hits += on_device
            host_hits += on_host
        return device_hits, host_hits

    def reset_hits(self) -> None:
        with self._cpu_hits_lock:
            self._cpu_hits = [0, 0]
        for counters in self._device_hits.values():
            counters.zero_()

    def nbytes_pinned(self) -> int:
        return self._pinned.nbytes if self._pinned is not None else 0

    def free(self) -> None:
        """Frees the tiers; the caller has synchronized the streams that read them."""
        if self._pinned is not None:
            self._pinned.free()
            self._pinned = None
        self.host_table = self.device_table = None
