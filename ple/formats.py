"""Row formats: how the bytes of a row become values."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowFormat:
    name: str
    safetensors_dtype: str
    storage: torch.dtype  # the dtype of one stored value
    scaled: bool  # whether the table's scale multiplies the values

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def default_dtype(self) -> torch.dtype:
        """What disk_gather returns when no dtype is asked for."""
        return self.storage if self.storage.is_floating_point and not self.scaled else torch.float32


FORMATS = {
    f.name: f
    for f in (
        RowFormat("f32", "F32", torch.float32, scaled=False),
        RowFormat("f16", "F16", torch.float16, scaled=False),
        RowFormat("bf16", "BF16", torch.bfloat16, scaled=False),
        RowFormat("fp8_e4m3fn", "F8_E4M3", torch.float8_e4m3fn, scaled=True),
        RowFormat("u8", "U8", torch.uint8, scaled=True),
        RowFormat("i8", "I8", torch.int8, scaled=True),
    )
}
BY_SAFETENSORS_DTYPE = {f.safetensors_dtype: f for f in FORMATS.values()}
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
