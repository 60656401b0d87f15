"""Lookahead: the rows of a prompt's coming prefill chunks, read while the
current chunk computes.

A chunked prefill runs the model once per chunk of the prompt, and the rows
of chunk k + 1 are known before chunk k runs.  A layer told the coming
chunks (``layer.lookahead(...)``) prefetches their rows (``Table.prefetch``)
on the table's prefetch thread, at most ``max_bytes`` of rows ahead of the
chunk being gathered; each forward takes its chunk's rows from its prefetch
instead of reading them, and then prefetches the chunks that fit again.  So
each chunk waits for the larger of its compute and its reads, not their sum.

The plan trusts the order of the forwards and checks only their size: a
forward of another size than the next chunk's ends the plan, and one of the
right size but other ids finds no prefetch of its ids and reads its own rows.
The bytes are right either way; ``prefetch_hits`` counts the chunks served.
``end_lookahead()`` drops what was read ahead and not gathered, and returns
once none of it is being read.
"""

from __future__ import annotations

from collections import deque

import torch

from ple.table import Table

from .parallel import RowSplit, prefetch

# Rows read ahead per layer by default, beyond the chunk being gathered: two
# 2,048-token chunks of a 16-head n-gram layer of 160 B rows take 10.5 MB.
DEFAULT_MAX_BYTES = 64 << 20
# What a table's prefetches may hold before the oldest are dropped
# (kernels/prefetch_queue.h, kMaxPendingBytes).
MOST_BYTES = 256 << 20


class Lookahead:
    """The coming chunks of one layer's forwards: their row ids (CPU int64,
    each as one forward will gather it), and what is read ahead.

    The bound covers every chunk whose rows a prefetch holds: those not yet
    forwarded and those whose gather a forward has enqueued on a GPU that has
    not reached it yet (the host thread runs ahead of the stream).  Where
    the next chunk does not fit, the forward waits for the oldest of those
    gathers before it reads ahead."""

    def __init__(self, table: Table, split: RowSplit | None, chunks: list[torch.Tensor],
                 max_bytes: int):
        if not isinstance(max_bytes, int) or not 0 < max_bytes <= MOST_BYTES:
            raise ValueError(f"ple: lookahead max_bytes must be an int in (0, {MOST_BYTES}] (a "
                             f"table's prefetches hold at most that), not {max_bytes!r}")
        self.table = table
        self.split = split
        self.max_bytes = max_bytes
        self._coming = deque(chunks)
        self._read_ahead: deque[int] = deque()  # ids of each prefetched chunk not yet forwarded
        # Ids of each chunk forwarded on a GPU, and an event past its gather.
        self._in_flight: deque[tuple[int, torch.cuda.Event]] = deque()
        self._fill()

    @property
    def bytes_ahead(self) -> int:
        """The rows' bytes of the chunks read ahead and not yet gathered."""
        ids = sum(self._read_ahead) + sum(n for n, _ in self._in_flight)
        return ids * self.table.row_bytes

    def _fill(self) -> None:
        """Prefetches the next chunks while they fit in max_bytes (always one)."""
        while self._in_flight and self._in_flight[0][1].query():
            self._in_flight.popleft()
        while self._coming:
            wanted = self._coming[0].numel() * self.table.row_bytes
            while self.bytes_ahead and self.bytes_ahead + wanted > self.max_bytes:
                if not self._in_flight:
                    return
                self._in_flight.popleft()[1].synchronize()
            prefetch(self.table, self._coming.popleft(), self.split)
            self._read_ahead.append(wanted // self.table.row_bytes)

    def gathered(self, n: int, device: torch.device) -> bool:
        """A forward has enqueued the gather of ``n`` ids on ``device``: reads
        ahead what now fits.  Returns False when the plan has ended (the
        chunks are done, or ``n`` is not the next chunk's size)."""
        if not self._read_ahead or self._read_ahead[0] != n:
            self.end()
            return False
        self._read_ahead.popleft()
        if device.type == "cuda":
            gathered = torch.cuda.Event()
            gathered.record(torch.cuda.current_stream(device))
            self._in_flight.append((n, gathered))
        self._fill()
        return bool(self._read_ahead)

    def end(self) -> None:
        """Drops the table's prefetches that no gather has taken."""
        self._coming.clear()
        self._read_ahead.clear()
        self._in_flight.clear()
        self.table.drop_prefetches()


class LooksAhead:
    """``lookahead`` for a layer over ``self.table`` and ``self.split``: the
    layer's ``lookahead`` method builds the chunks' ids and calls
    :meth:`_look_ahead`; its forward calls :meth:`_gathered` with the ids
    after their gather."""

    _lookahead: Lookahead | None = None

    def _look_ahead(self, chunks: list[torch.Tensor], max_bytes: int) -> None:
        self.end_lookahead()
        if chunks:
            self._lookahead = Lookahead(self.table, self.split, chunks, max_bytes)

    @torch.compiler.disable
    def _gathered(self, ids: torch.Tensor) -> None:
        if not self._lookahead.gathered(ids.numel(), ids.device):
            self._lookahead = None

    def end_lookahead(self) -> None:
        """Ends a ``lookahead`` plan: the rows read ahead and not gathered are
        dropped, and no read of them runs when this returns.  (It drops every
        prefetch of the table that no gather has taken.)"""
        if self._lookahead is not None:
            self._lookahead.end()
            self._lookahead = None

    @property
    def looking_ahead(self) -> bool:
        """Whether a ``lookahead`` plan has chunks to come."""
        return self._lookahead is not None

    @property
    def lookahead_bytes(self) -> int:
        """The rows' bytes read ahead for chunks not yet gathered (at most
        the plan's ``max_bytes``, or one chunk's when that is larger); on a
        GPU, a forwarded chunk counts until the stream has passed its gather."""
        return 0 if self._lookahead is None else self._lookahead.bytes_ahead


def chunk_ids(ids: torch.Tensor, chunk_size: int, dim: int) -> list[torch.Tensor]:
    """``ids`` (a CPU copy is made) split into chunks of ``chunk_size`` along
    ``dim``, each flattened as a forward's gather flattens it (int64)."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"ple: chunk_size must be a positive int, not {chunk_size!r}")
    ids = torch.as_tensor(ids).to("cpu", torch.int64)
    return [chunk.reshape(-1) for chunk in ids.split(chunk_size, dim=dim)]
