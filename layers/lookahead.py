"""Lookahead: the rows of a prompt's coming prefill chunks, read while the
current chunk computes.

A chunked prefill runs the model once per chunk of the prompt, and the rows
of chunk k + 1 are known before chunk k runs.  A layer told the coming
chunks (``layer.lookahead(layer.row_ids(prompt), chunk_size)``) gives them to
its table as a plan (``Table.plan_prefetches``) under the layer's own
prefetch owner: the table prefetches them on its prefetch thread, at most
``max_bytes`` of rows ahead of the chunk being gathered, and each forward's
gather takes its chunk's rows from its prefetch instead of reading them, and
lets the chunks that fit again be read.  So each chunk waits for the larger
of its compute and its reads, not their sum.

The plan lives in the table's prefetch queue, and advances inside the
gathers when they run (on the host, in a CUDA stream's host function, on a
captured graph's replays); the forward only passes the layer's owner to
``disk_gather``.  So a forward has no branch and no bookkeeping of its own: a
compiled forward (``torch.compile(fullgraph=True)``) and a captured CUDA
graph replayed per chunk look ahead as the eager forward does, and
forwards enqueued on a GPU ahead of the stream read nothing more ahead until
their gathers run.

The bound holds whatever the forwards do.  A plan's prefetches are its
owner's: the bound counts every row they hold, as the table reports it, until
a gather takes them or the plan drops them, and ending a plan drops its own
prefetches alone (other layers on the same table keep theirs).  A gather of
the layer's of other ids than the next chunk's (ids the plan did not foresee,
or another size) and a gather that raises each end the plan, dropping what
it read ahead; the forwards after it read their own rows.  The bytes are
right either way; ``prefetch_hits`` counts the chunks served.
``end_lookahead()`` drops what was read ahead and not gathered, and returns
once none of it is being read; so does collecting the layer.  The plan
changes under the queue's lock, so forwards on several threads and a thread
that plans anew see whole plans.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque

import torch

from ple.kernels.native import native
from ple.ops.disk_gather import checked_ids
from ple.table import Table

from .parallel import prefetch

# Rows read ahead per layer by default, beyond the chunk being gathered: two
# 2,048-token chunks of a 16-head n-gram layer of 160 B rows take 10.5 MB.
DEFAULT_MAX_BYTES = 64 << 20
# What a table's prefetches may hold before the oldest are dropped.
MOST_BYTES = native.MAX_PENDING_BYTES

# Owners of prefetches (Table.prefetch's owner): one per layer and per
# ReadAhead; 0 is nobody's.
_owners = itertools.count(1)


def check_max_bytes(max_bytes) -> None:
    if (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
            or not 0 < max_bytes <= MOST_BYTES):
        raise ValueError(f"ple: lookahead max_bytes must be an int in (0, {MOST_BYTES}] (a "
                         f"table's prefetches hold at most that), not {max_bytes!r}")


def lookahead_mib(value, where: str, given=None) -> int:
    """``value``, a lookahead bound in MiB: an int from 0 (no lookahead) to
    what a table's prefetches hold.  Anything else is a ValueError that names
    ``where`` (the argument, variable or key that set it) and the value as
    it was ``given`` (default: ``value``; a variable's text, say, that the
    caller read as ``value``, or as None where it is no whole number)."""
    most = MOST_BYTES >> 20
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        given = value if given is None else given
        raise ValueError(f"ple: {where} must be MiB of rows read ahead, an integer in "
                         f"[0, {most}] (0: no lookahead), not {given!r}")
    return value


class ReadAhead:
    """The chunks of rows one planner has prefetched on a table for forwards
    that it steps itself (the vLLM plugin's, before and after each engine
    step), in the order of those forwards, under an owner of its own: each
    chunk is the tickets of its prefetches (one per module reading it).  A
    layer's own plan lives in the table instead (``Table.plan_prefetches``).

    ``held_bytes`` is what the table says the owner's prefetches hold: the
    chunks not yet forwarded, and those whose gather a forward has enqueued
    on a GPU that has not reached it yet (the host thread runs ahead of the
    stream).  Once a forwarded chunk's gather has run, what it left of the
    chunk is dropped and the chunk counts as missed.  Not thread-safe: its
    user calls it from one thread at a time."""

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
    """A plan that a layer's ``lookahead`` started on its table: the layer's
    prefetch owner and the plan's number (``Table.plan_prefetches``)."""

    def __init__(self, table: Table, owner: int, number: int):
        self.table = table
        self.owner = owner
        self.number = number

    @property
    def looking_ahead(self) -> bool:
        """Whether chunks of this plan are still to be gathered."""
        return self.table.planning(self.owner, self.number)

    @property
    def bytes_ahead(self) -> int:
        """The rows' bytes that the plan's prefetches hold (0 once it ended)."""
        return self.table.prefetched_bytes(self.owner) if self.looking_ahead else 0

    def end(self) -> None:
        """Drops the plan's prefetches that no gather has taken, unless another
        plan of the layer has replaced it."""
        self.table.end_plan(self.owner, self.number)


class LooksAhead:
    """What the three layers share about the rows they gather: each layer has
    ``table`` and ``split``, defines ``row_ids`` and gathers with
    ``owner=self.prefetch_owner``; this gives it ``prefetch``, ``lookahead``
    and ``end_lookahead``.  ``TOKEN_DIM``: the dimension of ``row_ids``'
    output along which a prompt's tokens lie (the last for a token table; the
    one before the hash heads for an n-gram layer)."""

    TOKEN_DIM = -1

    def __init__(self):
        super().__init__()
        # A number of its own: its plans' prefetches, and the gathers that
        # advance them, are the layer's alone.
        self.prefetch_owner = next(_owners)

    def row_ids(self, token_ids: torch.Tensor, seq_ids: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """The table rows a forward of these arguments gathers, int64 on their
        device (a planner passes CPU tensors)."""
        raise NotImplementedError

    def prefetch(self, token_ids: torch.Tensor, seq_ids: torch.Tensor | None = None,
                 context: torch.Tensor | None = None) -> None:
        """Starts reading the rows of a later forward with these arguments
        (equal to the ones that forward gets), so that its gather takes them
        instead of reading them itself."""
        prefetch(self.table, self.row_ids(token_ids, seq_ids, context), self.split)

    def lookahead(self, row_ids: torch.Tensor, chunk_size: int,
                  max_bytes: int = DEFAULT_MAX_BYTES, dim: int | None = None
                  ) -> Lookahead | None:
        """The next forwards are the chunks ``row_ids.split(chunk_size, dim)``
        in order, ``row_ids`` being the rows of a whole prompt as
        :meth:`row_ids` gives them (``dim``: ``TOKEN_DIM`` by default; a
        batch ``[batch, length]`` is split along its length, as transformers'
        chunked prefill splits it).  Their rows are read ahead, at most
        ``max_bytes`` beyond the chunk being gathered (``ple.layers.lookahead``).
        Replaces the layer's plan.  Returns the plan (None: no chunks, or
        every row is in the table's tiers), for ``end_lookahead(plan)``."""
        ids = checked_ids(row_ids, "ple: lookahead")
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ple: lookahead takes row ids as an int32 or int64 tensor "
                            f"(layer.row_ids(...)), not {ids.dtype}")
        check_max_bytes(max_bytes)
        dim = self.TOKEN_DIM if dim is None else dim
        if not -ids.dim() <= dim < ids.dim():
            raise ValueError(f"ple: lookahead splits the row ids {list(ids.shape)} along dim "
                             f"{dim}, which they do not have: pass layer.row_ids(...) of the "
                             f"whole prompt")
        chunks = chunk_ids(ids, chunk_size, dim)
        table = self.table
        if ids.numel() == 0 or table.resident_range == (0, table.num_rows):
            chunks = []  # nothing to read from the files
        if self.split is not None:
            chunks = [self.split.ids_to_gather(chunk) for chunk in chunks]
        self._end_plan_when_collected()
        number = table.plan_prefetches(self.prefetch_owner, chunks, max_bytes)
        return Lookahead(table, self.prefetch_owner, number) if number else None

    def end_lookahead(self, plan: Lookahead | None = None) -> None:
        """Ends a ``lookahead`` plan: ``plan`` (one that ``lookahead``
        returned), or else the layer's.  The rows it read ahead and no gather
        took are dropped, and no read of them runs when this returns.  Other
        prefetches of the table (another plan's, the layer's own
        ``prefetch`` included) stay.  After ``close()`` there is nothing left
        to drop, and it does nothing."""
        if plan is not None:
            plan.end()
        else:
            self.table.end_plan(self.prefetch_owner)

    @property
    def looking_ahead(self) -> bool:
        """Whether a ``lookahead`` plan has chunks to come."""
        return self.table.planning(self.prefetch_owner)

    @property
    def lookahead_bytes(self) -> int:
        """The rows' bytes that the plan's prefetches hold, as the table
        counts them: chunks read ahead and not yet gathered, at most the
        plan's ``max_bytes`` (or one chunk's, when that is larger)."""
        return self.table.prefetched_bytes(self.prefetch_owner)

    def _end_plan_when_collected(self) -> None:
        """Makes the layer's collection end its plan on its table: a plan
        whose layer is gone gives back the rows and row-cache pins it holds
        (on a table other layers keep open)."""
        ends = self.__dict__.get("_ends_plan")
        if ends is not None and ends.alive and ends.peek()[2][0]() is self.table:
            return
        ends = weakref.finalize(self, _end_plan, weakref.ref(self.table), self.prefetch_owner)
        ends.atexit = False  # the process's end frees everything
        self.__dict__["_ends_plan"] = ends

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickling) has no plan: the original's
        prefetches are on the original's table."""
        state = dict(super().__getstate__())
        state.pop("_ends_plan", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.prefetch_owner = next(_owners)  # a copy's gathers are not the original's


def _end_plan(table: weakref.ref, owner: int) -> None:
    opened = table()
    if opened is not None:
        opened.end_plan(owner)


def chunk_ids(ids: torch.Tensor, chunk_size: int, dim: int) -> list[torch.Tensor]:
    """``ids`` (a CPU copy is made) split into chunks of ``chunk_size`` along
    ``dim``, each flattened as a forward's gather flattens it (int64)."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"ple: chunk_size must be a positive int, not {chunk_size!r}")
    ids = torch.as_tensor(ids).to("cpu", torch.int64)
    return [chunk.reshape(-1) for chunk in ids.split(chunk_size, dim=dim)]
