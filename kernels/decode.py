"""The CPU row decoder: raw row bytes to values, with torch's own conversions."""

from __future__ import annotations

import torch

from ple.formats import RowFormat


def decode_rows(raw: torch.Tensor, fmt: RowFormat, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``raw``: contiguous uint8 ``[..., row_bytes]``.  Scaled formats are
    widened to float32 and multiplied by ``scale`` there, then cast to
    ``dtype``; the other formats are cast directly.  GGUF block formats are
    decoded to float32 by the gguf package's own dequantize, then cast."""
    if fmt.is_block:
        return _decode_blocks(raw, fmt).to(dtype)
    values = raw.view(fmt.storage)
    if fmt.scaled:
        values = values.to(torch.float32)
        if scale != 1.0:
            values = values * scale
    return values.to(dtype)


def _decode_blocks(raw: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    cols = raw.shape[-1] // fmt.block_bytes * fmt.block_size
    if raw.numel() == 0:
        return torch.empty((*raw.shape[:-1], cols), dtype=torch.float32)
    values = dequantize(raw.reshape(-1, raw.shape[-1]).numpy(), GGMLQuantizationType(fmt.gguf_type))
    return torch.from_numpy(values).reshape(*raw.shape[:-1], cols)
