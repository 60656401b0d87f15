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
skips their ids, and a first kernel assembles each row from its tier before
the decode; with every row resident, steps 1 and 2 do not run.
"""

from __future__ import annotations

import torch

from ple.kernels.decode_gguf_triton import decode_blocks_triton
from ple.kernels.decode_triton import decode_rows_triton
from ple.kernels.tier_rows_triton import assemble_rows_triton
from ple.kernels.native import native
from ple.table import Table

# Staged bytes up to this size are read by the kernel straight from pinned
# memory; larger requests are copied to the device first.  See README
# "Performance" for the measurement behind it.
UVA_MAX_BYTES = 1 << 20


def disk_gather_cuda(table: Table, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    stream = torch.cuda.current_stream(ids.device)
    staging = table.staging_for(stream)
    error = native.take_host_error(table.handle, stream.cuda_stream)
    if not error and staging.take_bad_id_flag():
        error = f"an id was out of range [0, {table.num_rows})"
    if error:
        raise RuntimeError(f"ple.disk_gather: an earlier call on this stream failed, and its "
                           f"output was NaN: {error}")
    out = torch.empty((*ids.shape, table.cols), dtype=dtype, device=ids.device)
    n = ids.numel()
    if n == 0:
        return out
    capturing = torch.cuda.is_current_stream_capturing()
    placement = table.placement
    if placement is not None and placement.device_rows and placement.device != ids.device:
        # Another GPU's memory is not readable here without peer access.
        raise ValueError(f"ple.disk_gather: table {table.name!r} keeps its device tier on "
                         f"{placement.device}, and the ids are on {ids.device}")
    on_disk = placement is None or placement.resident_range != (0, table.num_rows)
    if on_disk:
        staging.reserve(n, capturing)
        staged_ids = staging.ids.bytes[: 8 * n].view(torch.int64)
        staged_ids.copy_(ids.reshape(-1).to(torch.int64), non_blocking=True)
        native.launch_host_gather(stream.cuda_stream, table.handle, staged_ids.data_ptr(), n,
                                  *table.resident_range, staging.rows.bytes.data_ptr(),
                                  staging.status.bytes.data_ptr(), capturing)
        staged = staging.rows.bytes[: n * table.row_bytes].view(n, table.row_bytes)
        if staged.numel() > UVA_MAX_BYTES:
            staged = staged.to(ids.device, non_blocking=True)
        status = staging.status.bytes[:4].view(torch.int32)
    with torch.cuda.device(ids.device):
        if placement is not None:
            placement.captured |= capturing
            rows = torch.empty((n, table.row_bytes), dtype=torch.uint8, device=ids.device)
            tier_status = torch.zeros(1, dtype=torch.int32, device=ids.device)
            assemble_rows_triton(ids.reshape(-1), rows, placement.device_table,
                                 placement.host_table, staged if on_disk else None,
                                 placement.first_row, table.num_rows,
                                 placement.hits_on(ids.device),
                                 status if on_disk else None, tier_status,
                                 # No host gather checks these ids: the next call learns of a bad one here.
                                 None if on_disk else staging.bad_id_flag.bytes[:4].view(torch.int32))
            staged, status = rows, tier_status
        decode = decode_blocks_triton if table.row_format.is_block else decode_rows_triton
        decode(staged, table.row_format, table.scale, out.view(n, table.cols), status=status)
    return out
