"""The CUDA kernel of ``disk_gather``.

In stream order on the current stream, with nothing that blocks the calling
thread, so that the whole operator can be captured in a CUDA graph:

1. the ids are copied into the table's pinned ids buffer for this stream;
2. the native gather runs as a host function in the stream
   (``cuLaunchHostFunc``) and fills the pinned staging buffer, or takes the
   rows of a matching ``table.prefetch``;
3. the Triton kernel decodes the staged rows into a new device tensor, reading
   them over UVA (small requests) or from a device copy (large ones).
"""

from __future__ import annotations

import torch

from ple.kernels.decode_triton import decode_rows_triton
from ple.kernels.native import native
from ple.table import Table

# Staged bytes up to this size are read by the kernel straight from pinned
# memory; larger requests are copied to the device first.  See README
# "Performance" for the measurement behind it.
UVA_MAX_BYTES = 1 << 20


def disk_gather_cuda(table: Table, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if table.row_format.is_block:
        raise NotImplementedError(f"ple.disk_gather: {table.format} rows are decoded on the CPU "
                                  "only for now; gather them with CPU ids")
    stream = torch.cuda.current_stream(ids.device)
    error = native.take_host_error(table.handle, stream.cuda_stream)
    if error:
        raise RuntimeError(f"ple.disk_gather: an earlier call on this stream failed in its host "
                           f"gather, and its output was NaN: {error}")
    out = torch.empty((*ids.shape, table.cols), dtype=dtype, device=ids.device)
    n = ids.numel()
    if n == 0:
        return out
    capturing = torch.cuda.is_current_stream_capturing()
    staging = table.staging_for(stream)
    staging.reserve(n, capturing)
    staged_ids = staging.ids.bytes[: 8 * n].view(torch.int64)
    staged_ids.copy_(ids.reshape(-1).to(torch.int64), non_blocking=True)
    native.launch_host_gather(stream.cuda_stream, table.handle, staged_ids.data_ptr(), n,
                              staging.rows.bytes.data_ptr(), staging.status.bytes.data_ptr(),
                              capturing)
    staged = staging.rows.bytes[: n * table.row_bytes].view(n, table.row_bytes)
    if staged.numel() > UVA_MAX_BYTES:
        staged = staged.to(ids.device, non_blocking=True)
    with torch.cuda.device(ids.device):
        decode_rows_triton(staged, table.row_format, table.scale, out.view(n, table.cols),
                           status=staging.status.bytes[:4].view(torch.int32))
    return out
