"""Row formats: how the bytes of a row become values."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowFormat:
    name: str
    safetensors_dtype: str | None  # None: not a safetensors dtype
    storage: torch.dtype  # the dtype of one stored value (uint8 for GGUF blocks)
    scaled: bool  # whether the table's scale multiplies the values
    gguf_type: int | None = None  # the GGMLQuantizationType, for GGUF tables
    block_size: int = 1  # values per block; GGUF block formats pack 32 or 256
    block_bytes: int = 0  # bytes per block; 0: one value of `storage`

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def is_block(self) -> bool:
        """Values packed in blocks with their own scales (GGUF quants)."""
        return self.block_size > 1

    def row_bytes(self, cols: int) -> int:
        if self.is_block:
            return cols // self.block_size * self.block_bytes
        return cols * self.itemsize

    @property
    def default_dtype(self) -> torch.dtype:
        """What disk_gather returns when no dtype is asked for."""
        return self.storage if self.storage.is_floating_point and not self.scaled else torch.float32


VALUE_FORMATS = {
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


def _block_format(name: str, gguf_type: int, block_size: int, block_bytes: int) -> RowFormat:
    return RowFormat(name, None, torch.uint8, scaled=False, gguf_type=gguf_type,
                     block_size=block_size, block_bytes=block_bytes)


# GGUF block formats, every type gguf.quants.dequantize decodes: the GGML type,
# values and bytes per block (gguf.GGML_QUANT_SIZES); values are
# gguf.quants.dequantize's (docs/design.md, "Formats").
BLOCK_FORMATS = {
    f.name: f
    for f in (
        _block_format("q4_0", 2, 32, 18),
        _block_format("q4_1", 3, 32, 20),
        _block_format("q5_0", 6, 32, 22),
        _block_format("q5_1", 7, 32, 24),
        _block_format("q8_0", 8, 32, 34),
        _block_format("q2_k", 10, 256, 84),
        _block_format("q3_k", 11, 256, 110),
        _block_format("q4_k", 12, 256, 144),
        _block_format("q5_k", 13, 256, 176),
        _block_format("q6_k", 14, 256, 210),
        _block_format("iq2_xxs", 16, 256, 66),
        _block_format("iq2_xs", 17, 256, 74),
        _block_format("iq3_xxs", 18, 256, 98),
        _block_format("iq1_s", 19, 256, 50),
        _block_format("iq4_nl", 20, 32, 18),
        _block_format("iq3_s", 21, 256, 110),
        _block_format("iq2_s", 22, 256, 82),
        _block_format("iq4_xs", 23, 256, 136),
        _block_format("iq1_m", 29, 256, 56),
        _block_format("tq1_0", 34, 256, 54),
        _block_format("tq2_0", 35, 256, 66),
        _block_format("mxfp4", 39, 32, 17),
        _block_format("nvfp4", 40, 64, 36),
    )
}
# Every row format a table can have, by its name (``table.format``).
FORMATS = {**VALUE_FORMATS, **BLOCK_FORMATS}
BY_SAFETENSORS_DTYPE = {f.safetensors_dtype: f for f in VALUE_FORMATS.values()}
# By the name of the GGML type (gguf.GGMLQuantizationType).
BY_GGUF_TYPE = {"F32": FORMATS["f32"], "F16": FORMATS["f16"], "BF16": FORMATS["bf16"],
                **{f.name.upper(): f for f in BLOCK_FORMATS.values()}}
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def applied_scale(scale: float, dtype: torch.dtype, round_scale: bool) -> float:
    """The float32 value by which a scaled row's values (fp8_e4m3fn, u8, i8),
    widened to float32, are multiplied before the product is rounded to
    ``dtype``: the table's ``scale`` as float32, or, with ``round_scale``,
    that float32 rounded to ``dtype`` first (to nearest even, as a loader
    casts an F32 ``weight_scale`` to the model's dtype).

    With ``round_scale`` the decoders therefore compute what a model holding
    its scale in ``dtype`` computes, ``values.to(dtype) * scale.to(dtype)``
    (transformers' ``FP8Embedding``, vLLM's Qwen4Exp): every fp8, u8 and i8
    value converts to float16 and bfloat16 exactly, and torch multiplies
    float16 and bfloat16 in float32 and rounds the product once, on the CPU
    and on CUDA.  ``tests/test_scale_arithmetic.py`` checks the identity for
    every value against torch and against an exact NumPy product.

    Cached: every gather asks for it, and building the tensors takes about
    6 us (2-core development machine), more than the 1.4 to 2.3 us of a warm
    decode step's native gather on the H200 machine; the cache takes 0.14 us."""
    value = torch.tensor(scale, dtype=torch.float32)
    return float(value.to(dtype) if round_scale else value)


# A row wider than this cannot be in any file: only a table of no rows could
# claim it, and the native code counts bytes in int64.
MAX_ROW_BYTES = 1 << 48


def check_row_bytes(tensor: str, row_bytes: int) -> None:
    """A ValueError naming ``tensor`` when its rows are wider than MAX_ROW_BYTES."""
    if row_bytes > MAX_ROW_BYTES:
        raise ValueError(f"{tensor} has rows of {row_bytes} bytes, more than {MAX_ROW_BYTES}")
