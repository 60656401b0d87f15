"""The CUDA kernel of ``disk_gather``.

In stream order on the current stream, with nothing that blocks the calling
thread, so that the whole operator can be captured in a CUDA graph:

1. the ids are copied into the table's pinned ids buffer for this stream;
2. the native gather runs as a host function in the stream
   (``cuLaunchHostFunc``) and fills the pinned staging buffer, or takes the
   rows of a matching ``table.prefetch``;
3. the Triton kernel decodes the staged rows into a new device tensor, reading
   them over UVA (small requests) or from a device copy (large ones).

When the table has device and host tiers (``Table.place``), the host gather
skips their ids, and the same kernel reads each row from its tier or from
the staged rows (kernels/tier_rows_triton.py); with every row resident, steps
1 and 2 do not run and the kernel checks the ids itself (a call of more than
``tier_rows_triton.SCAN_MAX_IDS`` ids has a small kernel check them first).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ple.kernels.decode_gguf_triton import decode_blocks_triton
from ple.kernels.decode_triton import decode_rows_triton
from ple.kernels.native import native
from ple.table import Table
from ple.tiers import Tiers

# Staged bytes up to this size are read by the kernel straight from pinned
# memory; larger requests are copied to the device first (the faster of the
# two for a decode step and for a prefill chunk, docs/figures/bench_gpu.md).
UVA_MAX_BYTES = 1 << 20


def disk_gather_cuda(table: Table, ids: torch.Tensor, dtype: torch.dtype, scale: float,
                     owner: int = 0) -> torch.Tensor:
    """``scale``: what scaled rows are multiplied by (``ple.formats.applied_scale``);
    ``owner``: the gather's prefetch owner (``disk_gather``'s argument)."""
    handle, tiers = table.acquire()
    try:
        return _gather(table, handle, tiers, ids, dtype, scale, owner)
    finally:
        table.release(tiers)


def _gather(table: Table, handle: int, tiers: Tiers | None, ids: torch.Tensor,
            dtype: torch.dtype, scale: float, owner: int) -> torch.Tensor:
    """disk_gather_cuda with the table's native handle and one snapshot of its tiers."""
    device = ids.device  # a new torch.device each time it is asked for
    capturing = torch.cuda.is_current_stream_capturing()
    staging = table.current_staging(device.index, capturing)
    _raise_earlier_error(table, handle, staging)
    out = torch.empty((*ids.shape, table.cols), dtype=dtype, device=device)
    n = ids.numel()
    if n == 0:
        return out
    resident_range = (0, 0)
    if tiers is not None:
        tiers.check_device(device, table.name)
        resident_range = tiers.resident_range
    on_disk = resident_range != (0, table.num_rows)

    rows = status = tier_read = None
    if on_disk:
        rows, status = staging.gather(handle, ids, resident_range, capturing, owner)
        if n * table.row_bytes > UVA_MAX_BYTES:
            rows = rows.to(device, non_blocking=True)
    # The kernels launch on the current device: the ids' (entering a device
    # context costs microseconds, so only when it is another).
    with nullcontext() if device.index == torch.cuda.current_device() else torch.cuda.device(device):
        if tiers is not None:
            # No host gather checks the ids when every row is resident: the
            # decoder does (or a kernel before it), and the next call learns
            # of a bad one.
            tier_read, status = tiers.read(ids, table.num_rows, status,
                                           None if on_disk else staging.bad_id_word, capturing)
        decode = decode_blocks_triton if table.row_format.is_block else decode_rows_triton
        decode(rows, table.row_format, scale, out.view(n, table.cols), status=status, tiers=tier_read)
    return out


def _raise_earlier_error(table: Table, handle: int, staging) -> None:
    """A host function cannot raise: the failure of an earlier call on this
    stream, whose output was NaN, is raised by the next call."""
    error = native.take_host_error(handle, staging.stream.cuda_stream)
    if not error and staging.take_bad_id_flag():
        error = f"an id was out of range [0, {table.num_rows})"
    if error:
        raise RuntimeError(f"ple.disk_gather: an earlier call on this stream failed, and its "
                           f"output was NaN: {error}")
