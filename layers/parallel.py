"""Tables split by rows across the ranks of a ``torch.distributed`` process
group, the way vocabulary-parallel embeddings are.

Rank r of W serves rows ``[r * ceil(N / W), min(N, (r + 1) * ceil(N / W)))``
of an N-row table.  Every rank gathers every id, clamped into its own range,
overwrites the rows of ids outside the range with -0.0, and the ranks sum
their results with ``all_reduce``, so each ends with the full rows.  The
shapes never depend on the ids, so the layer stays capturable in a CUDA graph
and traceable by ``torch.compile``.  -0.0 is the fill because ``x + -0.0 ==
x`` bit for bit for every x, +0.0 and -0.0 included: the sum gives each row
exactly as one process would.  Ids outside ``[0, N)`` give rows of zeros here,
where an unsplit gather raises.

The layers check each id argument with :func:`layer_ids`, call :func:`gather`
and :func:`prefetch` with their ``RowSplit``, or None when the table is not
split, and take ``place()`` from
:class:`PlacesServedRows`, which puts the rows a rank serves in its tiers: a
tier of another rank's rows would never be read, as every id outside the
rank's range is clamped into it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ple.ops.disk_gather import checked_ids
from ple.table import Table


def row_range(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, stop)``: the rows rank ``rank`` of ``world_size`` serves; empty
    (``start == stop == num_rows``) for the ranks past the end when
    ``world_size`` does not divide ``num_rows`` or exceeds it."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank {rank} of {world_size}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    per_rank = -(-num_rows // world_size)
    return min(num_rows, rank * per_rank), min(num_rows, (rank + 1) * per_rank)


class RowSplit:
    """This rank's share of a table's rows, and the group whose ranks hold the
    other shares (None: the default group, as in ``torch.distributed``)."""

    def __init__(self, num_rows: int, rank: int, world_size: int, process_group=None):
        if num_rows < 1:
            raise ValueError("a table of no rows cannot be split across ranks")
        self.num_rows = num_rows
        self.rank = rank
        self.world_size = world_size
        self.process_group = process_group
        self.start, self.stop = row_range(num_rows, rank, world_size)
        # A rank with no rows still gathers (row N - 1, masked away) so that
        # every rank runs the same ops.
        self._first = min(self.start, num_rows - 1)
        self._last = max(self._first, self.stop - 1)

    @classmethod
    def for_group(cls, num_rows: int, process_group) -> "RowSplit":
        """The split of this process's rank in ``process_group``."""
        return cls(num_rows, dist.get_rank(process_group), dist.get_world_size(process_group),
                   process_group)

    def ids_to_gather(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` clamped into this rank's range: what it gathers (and prefetches)."""
        return ids.clamp(self._first, self._last)

    def keep_own_rows(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``rows`` ``[*ids.shape, cols]`` with the rows of ids outside this
        rank's range set to -0.0."""
        own = (ids >= self.start) & (ids < self.stop)
        return torch.where(own.unsqueeze(-1), rows, -0.0)

    def __repr__(self) -> str:
        return (f"RowSplit(rank {self.rank} of {self.world_size}: rows [{self.start}, {self.stop}) "
                f"of {self.num_rows})")


def layer_ids(ids) -> torch.Tensor:
    """An id argument of a layer's (a tensor, a list, an array) as a tensor,
    checked as ``ple.gather`` checks its ids (``checked_ids``)."""
    return checked_ids(ids, "ple's embedding layers")


def gather(table: Table, ids: torch.Tensor, dtype: torch.dtype, split: RowSplit | None,
           round_scale: bool = False, scale: float | None = None, owner: int = 0
           ) -> torch.Tensor:
    """The rows ``ids`` (checked by :func:`layer_ids`) of ``table`` as
    ``dtype`` ``[*ids.shape, cols]``, on ``ids``' device, scaled as
    ``round_scale`` and ``scale`` say, for prefetch owner ``owner``
    (``disk_gather``'s arguments); with a split, this rank's share summed
    over the group."""
    if split is None:
        return torch.ops.ple.disk_gather(ids, table.handle, dtype, round_scale, scale, owner)
    rows = torch.ops.ple.disk_gather(split.ids_to_gather(ids), table.handle, dtype, round_scale,
                                     scale, owner)
    rows = split.keep_own_rows(rows, ids)
    dist.all_reduce(rows, group=split.process_group)
    return rows


def served_rows(split: RowSplit | None, start: int, stop: int) -> tuple[int, int]:
    """The rows of ``[start, stop)`` (the rows a layer reads) that this rank
    gathers: all of them without a split, else those in its range (an empty
    range at ``start`` or ``stop`` when it has none of them)."""
    if split is None:
        return start, stop
    begin = min(max(start, split.start), stop)
    return begin, max(begin, min(stop, split.stop))


def prefetch(table: Table, ids: torch.Tensor, split: RowSplit | None, owner: int = 0) -> int:
    """Starts gathering the host ids ``ids`` exactly as :func:`gather` will ask
    for them (the prefetch serves only a request of these ids first), for
    ``owner``; returns its ticket (``Table.prefetch``)."""
    return table.prefetch(ids if split is None else split.ids_to_gather(ids), owner)


class PlacesServedRows:
    """``served_rows`` and ``place()`` for a layer over a table: the layer has
    ``table`` and ``split``; one that reads only some of the table's rows
    overrides ``served_rows``."""

    @property
    def served_rows(self) -> tuple[int, int]:
        """``(start, stop)``: the table rows this layer gathers in this
        process, all of them (this rank's, with a split)."""
        return served_rows(self.split, 0, self.table.num_rows)

    def place(self, device_rows: int = 0, host_rows: int = 0, device=None, progress=None) -> None:
        """Keeps the first ``device_rows`` rows of :attr:`served_rows` in the
        memory of ``device`` (a GPU) and the next ``host_rows`` in host memory,
        as ``Table.place`` does; ``place()`` drops the tiers."""
        start, stop = self.served_rows
        counts = (device_rows, host_rows)
        # Arguments that are not counts are table.place's to reject, with its message.
        if all(isinstance(n, int) for n in counts) and sum(counts) > stop - start:
            raise ValueError(f"ple: device_rows + host_rows = {sum(counts)} is more than the "
                             f"{stop - start} rows [{start}, {stop}) of table {self.table.name!r} "
                             "that this layer gathers here")
        self.table.place(device_rows, host_rows, device, progress, first_row=start)
