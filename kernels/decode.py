"""The CPU row decoder: raw row bytes to values, with torch's own conversions."""

from __future__ import annotations

import torch

from ple.formats import RowFormat


def decode_rows(raw: torch.Tensor, fmt: RowFormat, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``raw``: contiguous uint8 ``[..., row_bytes]``.  Scaled formats are
    widened to float32 and multiplied by ``scale`` there, then cast to
    ``dtype``; the other formats are cast directly."""
    values = raw.view(fmt.storage)
    if fmt.scaled:
        values = values.to(torch.float32)
        if scale != 1.0:
            values = values * scale
    return values.to(dtype)
