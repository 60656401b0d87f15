"""Assembles the raw rows of a CUDA gather from the table's tiers, in one
Triton kernel: each row from device memory (the device tier), from pinned
host memory over UVA (the host tier) or from the staged disk rows.  The
decoder then reads the assembled rows as if they had all come from disk.

It also counts the rows each tier served, and checks the ids against the
table: with every row resident no host gather runs to do it.  A bad id, or a
failed host gather (``status_in``), sets ``status_out``, and the decoder
then writes NaN for the whole call; a bad id also sets ``report``, a pinned
word the host reads (and clears) at its next call.

Only imported where triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 16
MAX_BYTES_PER_PROGRAM = 1024


@triton.jit
def assemble_rows_kernel(ids_ptr, n, out_ptr, row_bytes, device_ptr, host_ptr, staged_ptr,
                         first_row, device_rows, tier_rows, num_rows, hits_ptr,
                         status_in_ptr, status_out_ptr, report_ptr, HAS_STAGED: tl.constexpr,
                         REPORT: tl.constexpr, ROWS: tl.constexpr, BYTES: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_call = rows < n
    ids = tl.load(ids_ptr + rows, mask=in_call, other=0).to(tl.int64)
    bad = in_call & ((ids < 0) | (ids >= num_rows))
    good = in_call & ~bad
    tier_row = ids - first_row  # the id's row in the tiers, when it has one
    on_device = good & (tier_row >= 0) & (tier_row < device_rows)
    on_host = good & (tier_row >= device_rows) & (tier_row < tier_rows)
    on_disk = good & ((tier_row < 0) | (tier_row >= tier_rows))

    cols = tl.program_id(1) * BYTES + tl.arange(0, BYTES)
    in_row = (cols < row_bytes)[None, :]
    cols = cols[None, :]
    from_device = tl.load(device_ptr + tier_row[:, None] * row_bytes + cols,
                          mask=on_device[:, None] & in_row, other=0)
    from_host = tl.load(host_ptr + (tier_row - device_rows)[:, None] * row_bytes + cols,
                        mask=on_host[:, None] & in_row, other=0)
    value = tl.where(on_device[:, None], from_device, from_host)
    if HAS_STAGED:
        from_disk = tl.load(staged_ptr + rows[:, None] * row_bytes + cols,
                            mask=on_disk[:, None] & in_row, other=0)
        value = tl.where(on_disk[:, None], from_disk, value)
    tl.store(out_ptr + rows[:, None] * row_bytes + cols, value, mask=in_call[:, None] & in_row)

    if tl.program_id(1) == 0:
        # Per-row atomics, not tl.sum: the interpreter that tests this kernel
        # without a GPU cannot run triton.language.standard's functions.
        first = tl.full([ROWS], 0, tl.int32)
        tl.atomic_add(hits_ptr + first, 1, mask=on_device)
        tl.atomic_add(hits_ptr + 1 + first, 1, mask=on_host)
        tl.atomic_max(status_out_ptr + first, 1, mask=bad)
        if REPORT:
            # Set, never cleared here: a good call enqueued before the host
            # read the word must not erase the report of a bad one.
            tl.store(report_ptr + first, 1, mask=bad)
        if HAS_STAGED:
            tl.atomic_max(status_out_ptr, tl.load(status_in_ptr))


def assemble_rows_triton(ids: torch.Tensor, out: torch.Tensor, device_table: torch.Tensor | None,
                         host_table: torch.Tensor | None, staged: torch.Tensor | None,
                         first_row: int, num_rows: int, hits: torch.Tensor,
                         status_in: torch.Tensor | None, status_out: torch.Tensor,
                         report: torch.Tensor | None = None) -> torch.Tensor:
    """Row ``i`` of ``out`` (uint8 ``[n, row_bytes]`` on the GPU) becomes row
    ``ids[i]`` of the tiers: ``device_table`` holds the rows from
    ``first_row`` on, ``host_table`` (pinned) the ones after those,
    ``staged`` (pinned or on the GPU) holds, at position ``i``, the disk
    rows.  ``staged`` and ``status_in`` go together: without them every id
    must be resident.  Adds the rows served to ``hits`` (int64 ``[device,
    host]``); sets ``status_out`` (int32) to 1 on a bad id or when
    ``status_in`` is nonzero, and ``report`` (int32, when given) to 1 on a
    bad id."""
    n, row_bytes = out.shape
    if n == 0:
        return out
    if (staged is None) != (status_in is None):
        raise ValueError("staged rows and their status come together")
    device_rows = 0 if device_table is None else device_table.shape[0]
    host_rows = 0 if host_table is None else host_table.shape[0]
    # Absent tiers are never read (their masks are all false): any pointer will do.
    placeholder = out
    block = min(MAX_BYTES_PER_PROGRAM, triton.next_power_of_2(row_bytes))
    grid = (triton.cdiv(n, ROWS_PER_PROGRAM), triton.cdiv(row_bytes, block))
    assemble_rows_kernel[grid](
        ids, n, out, row_bytes,
        placeholder if device_table is None else device_table,
        placeholder if host_table is None else host_table,
        placeholder if staged is None else staged,
        first_row, device_rows, device_rows + host_rows, num_rows, hits,
        status_out if status_in is None else status_in, status_out,
        status_out if report is None else report,
        HAS_STAGED=staged is not None, REPORT=report is not None, ROWS=ROWS_PER_PROGRAM, BYTES=block)
    return out
