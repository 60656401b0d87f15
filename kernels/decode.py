"""The CPU row decoder: raw row bytes to values, with torch's own conversions."""

from __future__ import annotations

import torch

from ple.formats import RowFormat

# Values decoded at a time when a conversion needs an intermediate (float32
# before the scale, the gguf package's float32 and its temporaries): the
# intermediate of a whole request would be several times the output (a
# float32 copy of 5M u8 rows of bf16 output: 2.1 GiB for 0.6 GiB out).  4 MiB
# of float32 per chunk keeps the peak near the output's size, and is large
# enough that the loop costs nothing measurable.
CHUNK_VALUES = 1 << 20


def decode_rows(raw: torch.Tensor, fmt: RowFormat, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``raw``: contiguous uint8 ``[..., row_bytes]``.  Scaled formats are
    widened to float32 and multiplied by ``scale`` there, then cast to
    ``dtype``; the other formats are cast directly.  ``scale`` is a float32
    value, ``ple.formats.applied_scale``'s: the table's scale, or that scale
    rounded to ``dtype``, which makes the product the one of a model that
    multiplies in ``dtype``.  GGUF block formats are decoded to float32 by
    the gguf package's own dequantize, then cast.
    Conversions that need a float32 intermediate run a chunk of rows at a
    time into the output (the same operations on each value, so the same
    bits), so that the memory they take beyond the output stays bounded."""
    if fmt.is_block:
        return _decode_blocks(raw, fmt, dtype)
    values = raw.view(fmt.storage)
    if not fmt.scaled:
        return values.to(dtype)
    if dtype == torch.float32:
        out = values.to(torch.float32)  # the output itself: no intermediate
        if scale != 1.0:
            out.mul_(scale)  # the same multiply as `out * scale`, in place
        return out

    return _widen_scale_chunked(values, scale, dtype)


def _widen_scale_chunked(values: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``(values.to(float32) * scale).to(dtype)`` for ``values`` ``[..., cols]``,
    a chunk of rows at a time through one float32 scratch buffer that every
    chunk reuses (``copy_`` widens as ``.to`` does, ``mul_`` multiplies as
    ``*`` does).  A new intermediate for each chunk let the allocator's peak
    wander: 8 to 28 MiB above a 64 MiB output on torch 2.9, 4 MiB with the
    one buffer."""
    out = torch.empty(values.shape, dtype=dtype)
    flat_in, flat_out = values.reshape(-1, values.shape[-1]), out.view(-1, values.shape[-1])
    step = max(1, CHUNK_VALUES // max(1, values.shape[-1]))
    wide = torch.empty((min(step, flat_in.shape[0]), flat_in.shape[1]), dtype=torch.float32)
    for begin in range(0, flat_in.shape[0], step):
        part = flat_in[begin:begin + step]
        scratch = wide[:part.shape[0]]
        scratch.copy_(part)
        if scale != 1.0:
            scratch.mul_(scale)
        flat_out[begin:begin + step].copy_(scratch)
    return out


def _decode_blocks(raw: torch.Tensor, fmt: RowFormat, dtype: torch.dtype) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    cols = raw.shape[-1] // fmt.block_bytes * fmt.block_size
    out = torch.empty((*raw.shape[:-1], cols), dtype=dtype)
    if out.numel() == 0:
        return out
    qtype = GGMLQuantizationType(fmt.gguf_type)
    flat_in, flat_out = raw.reshape(-1, raw.shape[-1]), out.view(-1, cols)
    step = max(1, CHUNK_VALUES // cols)
    # dequantize works block by block, so a chunk of rows decodes to the
    # values those rows have in the whole request.
    for begin in range(0, flat_in.shape[0], step):
        values = dequantize(flat_in[begin:begin + step].numpy(), qtype)
        flat_out[begin:begin + step].copy_(torch.from_numpy(values))
    return out
