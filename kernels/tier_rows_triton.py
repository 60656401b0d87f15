"""Where each row of a CUDA gather lies: device memory (the table's device
tier), pinned host memory read over UVA (the host tier) or the staged disk
rows.  The decoders (kernels/decode_triton.py, and the GGUF block decoders
that kernels/decode_gguf_triton.py launches) call ``call_row`` first and
read each row straight from its source, so that a call with tiers is one
kernel, with no assembled copy of its rows.

``call_row`` also counts the rows each tier served, and says whether the
call failed, in which case the decoder writes NaN for the whole call.  A call
fails when an id is out of range or its host gather failed.  With a host
gather, the gather checks every id that is not resident (bad ids never are)
and sets its status word.  With every row resident no host gather runs:

* a call of up to SCAN_MAX_IDS ids has every program check all its ids, which
  costs little at that size and needs no other kernel;
* a larger call first runs ``check_ids_kernel``, which sets a fresh status
  word that the decoder then reads.

Either way a bad id also sets ``report``, a pinned word the host reads (and
clears) at its next call.

Only imported where triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Calls with every row resident and at most this many ids are checked by every
# program of the decoder (a thousand int64 loads, from L2, for each row);
# larger ones by check_ids_kernel first.
SCAN_MAX_IDS = 1024
CHECK_BLOCK = 1024


@triton.jit
def either(a, b):
    """The combine function of an any() over bools.  tl.reduce with a function
    of ours, not tl.max: the interpreter that tests these kernels without a GPU
    cannot run triton.language.standard's functions."""
    return a | b


@triton.jit
def call_row(rows_ptr, status_ptr, row_bytes, ids_ptr, device_ptr, host_ptr, first_row,
             device_rows, tier_rows, num_rows, hits_ptr, report_ptr, TIERS: tl.constexpr,
             HAS_STATUS: tl.constexpr, SCAN_IDS: tl.constexpr):
    """For the decoder program of (row, column block): the address of its row's
    first byte, and whether the call failed (then nothing is to be read).

    Without ``TIERS`` row i is at ``rows_ptr + i * row_bytes``.  With it, row i
    is row ``ids[i]`` of the table: in the device tier (``device_ptr``, the
    rows from ``first_row`` on), the host tier (``host_ptr``, the next ones,
    up to ``tier_rows``) or else at position i of the staged rows; the rows
    served are added to ``hits`` (int64 [device, host]).  ``HAS_STATUS``: the
    int32 at ``status_ptr`` is nonzero when the call failed.  ``SCAN_IDS``
    (a power of two at least the number of ids, or 0): check every id against
    ``[0, num_rows)`` and set ``report`` on a bad one."""
    row = tl.program_id(0).to(tl.int64)
    if TIERS:
        # The tiers lie within the table, so a bad id is never found there.
        tier_row = tl.load(ids_ptr + row).to(tl.int64) - first_row
        on_device = (tier_row >= 0) & (tier_row < device_rows)
        on_host = (tier_row >= device_rows) & (tier_row < tier_rows)
        src = tl.where(on_device, device_ptr + tier_row * row_bytes,
                       tl.where(on_host, host_ptr + (tier_row - device_rows) * row_bytes,
                                rows_ptr + row * row_bytes))
        if tl.program_id(1) == 0:
            tl.atomic_add(hits_ptr + on_host.to(tl.int32), 1, mask=on_device | on_host)
    else:
        src = rows_ptr + row * row_bytes
    if HAS_STATUS:
        failed = tl.load(status_ptr) != 0
    else:
        failed = False
    if SCAN_IDS:
        offs = tl.arange(0, SCAN_IDS)
        ids = tl.load(ids_ptr + offs, mask=offs < tl.num_programs(0), other=0).to(tl.int64)
        any_bad = tl.reduce((ids < 0) | (ids >= num_rows), 0, either)
        failed = failed | any_bad
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            # Set, never cleared here: a good call enqueued before the host
            # read the word must not erase the report of a bad one.
            tl.store(report_ptr, 1, mask=any_bad)
    return src, failed


@triton.jit
def check_ids_kernel(ids_ptr, n, num_rows, status_ptr, report_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=0).to(tl.int64)
    bad = (offs < n) & ((ids < 0) | (ids >= num_rows))
    # Per-id atomics and stores, not a reduction: see ``either``.
    first = tl.full([BLOCK], 0, tl.int32)
    tl.atomic_max(status_ptr + first, 1, mask=bad)
    tl.store(report_ptr + first, 1, mask=bad)  # set, never cleared here (as in call_row)


class TierRead:
    """How the decoders read one call's rows from the tiers (``call_row``):
    ``kernel_args``, their arguments ``ids_ptr`` to ``report_ptr``;
    ``scan_ids``, their ``SCAN_IDS``; ``unread_rows``, a uint8 tensor for a
    rows pointer that is never read (no row staged).

    ``ids``: the call's ids (1-D, on the GPU); ``device_table`` /
    ``host_table``: the tiers (uint8 ``[rows, row_bytes]``, None for an empty
    one), from row ``first_row`` of the table on; ``hits``: the counters the
    call adds to; ``report``: the pinned word a bad id sets, given when no
    host gather checks the ids (every row resident).  Such a call of more
    than SCAN_MAX_IDS ids must have its ids checked by ``check_ids`` first."""

    __slots__ = ("kernel_args", "scan_ids", "unread_rows", "plan")

    def __init__(self, ids: torch.Tensor, device_table: torch.Tensor | None,
                 host_table: torch.Tensor | None, first_row: int, num_rows: int,
                 hits: torch.Tensor, report: torch.Tensor | None):
        n = ids.numel()
        device_rows = 0 if device_table is None else device_table.shape[0]
        host_rows = 0 if host_table is None else host_table.shape[0]
        scans = report is not None and n <= SCAN_MAX_IDS
        # A power of two at least n (not triton.next_power_of_2: microseconds a call).
        self.scan_ids = max(16, 1 << (n - 1).bit_length()) if scans else 0
        # An absent tier or report is never read: any pointer of its type will
        # do (call_row picks between the tiers' pointers, whose types must agree).
        no_tier = device_table if host_table is None else host_table
        if no_tier is None:
            no_tier = ids.view(torch.uint8)
        self.unread_rows = no_tier
        self.kernel_args = (ids, no_tier if device_table is None else device_table,
                            no_tier if host_table is None else host_table, first_row, device_rows,
                            device_rows + host_rows, num_rows, hits, report if scans else hits)
        # What of these a decoder's launch specializes on, but their addresses
        # (LaunchCache.launch_planned): the tiers and the hits are uint8 and int64
        # by construction, the report int32.
        self.plan = (ids.dtype, *self.kernel_args[3:7], self.scan_ids)


def check_ids(ids: torch.Tensor, num_rows: int, report: torch.Tensor) -> torch.Tensor:
    """A new int32 status word that becomes 1 when an id of ``ids`` (1-D, on
    the GPU) is outside ``[0, num_rows)``; such an id also sets ``report``."""
    status = torch.zeros(1, dtype=torch.int32, device=ids.device)
    n = ids.numel()
    check_ids_kernel[(triton.cdiv(n, CHECK_BLOCK),)](ids, n, num_rows, status, report,
                                                     BLOCK=CHECK_BLOCK)
    return status
