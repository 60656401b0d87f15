"""Lookahead: the rows of a prompt's coming prefill chunks, read while the
current chunk computes.

A chunked prefill runs the model once per chunk of the prompt, and the rows
of chunk k + 1 are known before chunk k runs.  A layer told the coming
chunks (``layer.lookahead(...)``) prefetches their rows (``Table.prefetch``)
on the table's prefetch thread, at most ``max_bytes`` of rows ahead of the
chunk being gathered; each forward takes its chunk's rows from its prefetch
instead of reading them, and then prefetches the chunks that fit again.  So
each chunk waits for the larger of its compute and its reads, not their sum.

The bound holds whatever the forwards do.  A plan's prefetches are its own
(an owner of the table's prefetches, :class:`ReadAhead`): the bound counts
every row they hold, as the table reports it, until a gather takes them or
the plan drops them, and ending a plan drops its own prefetches alone (other
layers on the same table keep theirs).  A forward of another size than the
next chunk's, a forward that leaves its chunk's prefetch untaken (other ids:
the plan did not foresee them) and a forward that raises each end the plan,
dropping what it read ahead; the forwards after it read their own rows.  The
bytes are right either way; ``prefetch_hits`` counts the chunks served.
``end_lookahead()`` drops what was read ahead and not gathered, and returns
once none of it is being read.

A plan changes its state under its own lock, so forwards on several threads
and a thread that plans anew see whole plans: a forward takes the layer's
plan once, and a plan ended meanwhile ignores it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable

import torch

from ple.table import Table

from .parallel import RowSplit, prefetch

logger = logging.getLogger(__name__)

# Rows read ahead per layer by default, beyond the chunk being gathered: two
# 2,048-token chunks of a 16-head n-gram layer of 160 B rows take 10.5 MB.
DEFAULT_MAX_BYTES = 64 << 20
# What a table's prefetches may hold before the oldest are dropped
# (kernels/prefetch_queue.h, kMaxPendingBytes).
MOST_BYTES = 256 << 20

# Owners of prefetches (Table.prefetch's owner), one per ReadAhead; 0 is nobody's.
_owners = itertools.count(1)


def check_max_bytes(max_bytes) -> None:
    if (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
            or not 0 < max_bytes <= MOST_BYTES):
        raise ValueError(f"ple: lookahead max_bytes must be an int in (0, {MOST_BYTES}] (a "
                         f"table's prefetches hold at most that), not {max_bytes!r}")


class ReadAhead:
    """The chunks of rows one reader has prefetched on a table for forwards to
    come, in the order of those forwards, under an owner of its own: each
    chunk is the tickets of its prefetches (one per module reading it).

    ``held_bytes`` is what the table says the owner's prefetches hold: the
    chunks not yet forwarded, and those whose gather a forward has enqueued
    on a GPU that has not reached it yet (the host thread runs ahead of the
    stream).  Once a forwarded chunk's gather has run, what it left of the
    chunk is dropped and the chunk counts as missed.  Not thread-safe: its
    user (a layer's plan, under the plan's lock; the vLLM plugin's planner,
    on its worker's thread) calls it from one thread at a time."""

    def __init__(self, table: Table, max_bytes: int):
        check_max_bytes(max_bytes)
        self.table = table
        self.max_bytes = max_bytes
        self.owner = next(_owners)
        self.missed = False  # a forwarded chunk's gather left some of its rows untaken
        self._waiting: deque[list[int]] = deque()  # chunks prefetched, not yet forwarded
        # Chunks forwarded on a GPU, with an event past their gather.
        self._in_flight: deque[tuple[list[int], torch.cuda.Event]] = deque()

    @property
    def held_bytes(self) -> int:
        return self.table.prefetched_bytes(self.owner)

    def room_for(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more rows fit in ``max_bytes`` (always, when
        nothing is held), waiting for the oldest gathers in flight on a GPU
        while they do not."""
        self.settle(wait=False)
        while True:
            held = self.held_bytes
            if held == 0 or held + nbytes <= self.max_bytes:
                return True
            if not self._in_flight:
                return False
            self.settle(wait=True)

    def add(self, tickets: list[int]) -> None:
        """Adds a chunk: the tickets of its prefetches, made for ``owner``."""
        self._waiting.append(tickets)

    def forwarded(self, device: torch.device) -> None:
        """A forward has enqueued the gather of the oldest waiting chunk on
        ``device``: on the CPU it has run, and what it did not take is dropped."""
        tickets = self._waiting.popleft()
        if device.type == "cuda":
            gathered = torch.cuda.Event()
            gathered.record(torch.cuda.current_stream(device))
            self._in_flight.append((tickets, gathered))
            self.settle(wait=False)
        else:
            self._drop_untaken(tickets)

    def end(self) -> None:
        """Drops every prefetch of the owner that no gather has taken: when it
        returns, none of them is read.  Nothing after a close."""
        self._waiting.clear()
        self._in_flight.clear()
        self.table.drop_prefetches(self.owner)

    def settle(self, wait: bool = False) -> None:
        """Drops what the gathers in flight that have run left untaken (with
        ``wait``: waits for the oldest one first)."""
        if wait and self._in_flight:
            self._in_flight[0][1].synchronize()
        while self._in_flight and self._in_flight[0][1].query():
            self._drop_untaken(self._in_flight.popleft()[0])

    def _drop_untaken(self, tickets: list[int]) -> None:
        if tickets and self.table.drop_prefetches(self.owner, through=max(tickets)):
            self.missed = True


class Lookahead:
    """The coming chunks of one layer's forwards: their row ids (CPU int64,
    each as one forward will gather it), and what is read ahead of them."""

    def __init__(self, table: Table, split: RowSplit | None, chunks: list[torch.Tensor],
                 max_bytes: int):
        self._ahead = ReadAhead(table, max_bytes)
        self.split = split
        self._coming = deque(chunks)
        self._sizes: deque[int] = deque()  # the ids of each chunk read ahead, not yet forwarded
        self._lock = threading.Lock()
        self.ended = False
        with self._lock:
            self._fill()

    @property
    def looking_ahead(self) -> bool:
        """Whether chunks are still to be forwarded."""
        with self._lock:
            return not self.ended and bool(self._sizes)

    @property
    def bytes_ahead(self) -> int:
        """The rows' bytes that the plan's prefetches hold (0 once ended)."""
        with self._lock:
            if self.ended:
                return 0
            self._ahead.settle()
            return self._ahead.held_bytes

    def gathered(self, n: int, device: torch.device) -> bool:
        """A forward has enqueued the gather of ``n`` ids on ``device``: reads
        ahead what now fits.  Returns False when the plan has ended (the
        chunks are done, ``n`` is not the next chunk's size, or a forward
        left its chunk's rows untaken).  A plan whose last chunk's gather is
        still in flight on a GPU goes on holding that chunk's rows until the
        stream takes them, or the next forward or ``end`` ends it.  When
        reading ahead fails after the gather, the plan ends and logs the error:
        the forward's rows are gathered all the same."""
        with self._lock:
            if self.ended:
                return False
            if not self._sizes or self._sizes[0] != n:
                self._end()
                return False
            try:
                self._sizes.popleft()
                self._ahead.forwarded(device)
                self._fill()
            except Exception:
                # The forward's rows are gathered: a failure of the plan's own
                # bookkeeping ends the plan, not the request.
                logger.exception("ple: a lookahead plan ended: its reads ahead failed")
                self._end()
                return False
            if self._ahead.missed or not self._sizes and not self._ahead.held_bytes:
                self._end()
                return False
            return True

    def end(self) -> None:
        """Drops the plan's prefetches that no gather has taken."""
        with self._lock:
            self._end()

    def _fill(self) -> None:
        """Prefetches the next chunks while they fit in max_bytes (always one)."""
        row_bytes = self._ahead.table.row_bytes
        while self._coming and not self._ahead.missed:
            if not self._ahead.room_for(self._coming[0].numel() * row_bytes):
                return
            chunk = self._coming.popleft()
            self._ahead.add([prefetch(self._ahead.table, chunk, self.split, self._ahead.owner)])
            self._sizes.append(chunk.numel())

    def _end(self) -> None:
        self.ended = True
        self._coming.clear()
        self._sizes.clear()
        self._ahead.end()


class LooksAhead:
    """``lookahead`` for a layer over ``self.table`` and ``self.split``: the
    layer's ``lookahead`` method builds the chunks' ids and calls
    :meth:`_look_ahead`; while it has a plan, its forward gathers through
    :meth:`_gather_planned`."""

    _lookahead: Lookahead | None = None

    def _look_ahead(self, chunks: list[torch.Tensor], max_bytes: int) -> Lookahead | None:
        """Makes the plan of ``chunks`` the layer's, and returns it (None: no chunks)."""
        with self._plan_lock:
            self._replace_plan(None)
            if chunks:
                self._replace_plan(Lookahead(self.table, self.split, chunks, max_bytes))
            return self._lookahead

    @torch.compiler.disable
    def _gather_planned(self, gather: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        """``gather(*args)``, the rows ``[*ids.shape, cols]`` of a forward's
        ids, as a forward of the layer's plan: the plan takes it as its next
        chunk, or ends (the forward raised, or was not its next chunk)."""
        plan = self._lookahead
        try:
            rows = gather(*args)
        except BaseException:
            if plan is not None:
                self._end_plan(plan)
            raise
        if plan is not None and not plan.gathered(rows.shape[:-1].numel(), rows.device):
            self._end_plan(plan)
        return rows

    @property
    def _plan_lock(self) -> threading.Lock:
        """Orders the changes of the layer's plan: a plan is ended before the
        next one reads ahead, so that the two never hold rows together.  Made
        at the first use (dict.setdefault is atomic), and left out of copies."""
        return self.__dict__.setdefault("_plan_lock_", threading.Lock())

    def _replace_plan(self, plan: Lookahead | None) -> None:
        """Makes ``plan`` the layer's, ending the one it replaces (under
        ``_plan_lock``)."""
        if self._lookahead is not None:
            self._lookahead.end()
        self._lookahead = plan

    def _end_plan(self, plan: Lookahead) -> None:
        """Ends ``plan``, and takes it from the layer unless another has replaced it."""
        with self._plan_lock:
            plan.end()
            if self._lookahead is plan:
                self._lookahead = None

    def end_lookahead(self, plan: Lookahead | None = None) -> None:
        """Ends a ``lookahead`` plan: ``plan`` (one that ``lookahead``
        returned), or else the layer's.  The rows it read ahead and no gather
        took are dropped, and no read of them runs when this returns.  Other
        prefetches of the table (another plan's, the layer's own included)
        stay.  After ``close()`` there is nothing left to drop, and it does
        nothing."""
        if plan is not None:
            self._end_plan(plan)
            return
        with self._plan_lock:
            self._replace_plan(None)

    @property
    def looking_ahead(self) -> bool:
        """Whether a ``lookahead`` plan has chunks to come."""
        plan = self._lookahead
        return plan is not None and plan.looking_ahead

    @property
    def lookahead_bytes(self) -> int:
        """The rows' bytes that the plan's prefetches hold, as the table
        counts them: chunks read ahead and not yet gathered, at most the
        plan's ``max_bytes`` (or one chunk's, when that is larger); on a GPU,
        a forwarded chunk counts until the stream has passed its gather."""
        plan = self._lookahead
        return 0 if plan is None else plan.bytes_ahead

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickling) has no plan: the original's
        prefetches are on the original's table."""
        state = dict(super().__getstate__())
        state.pop("_lookahead", None)
        state.pop("_plan_lock_", None)
        return state


def chunk_ids(ids: torch.Tensor, chunk_size: int, dim: int) -> list[torch.Tensor]:
    """``ids`` (a CPU copy is made) split into chunks of ``chunk_size`` along
    ``dim``, each flattened as a forward's gather flattens it (int64)."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"ple: chunk_size must be a positive int, not {chunk_size!r}")
    ids = torch.as_tensor(ids).to("cpu", torch.int64)
    return [chunk.reshape(-1) for chunk in ids.split(chunk_size, dim=dim)]
