"""The GPU row decoder: staged row bytes to values, in one Triton kernel.

Bit-identical to the CPU decoder (kernels/decode.py, torch's conversions): scaled
formats (fp8_e4m3fn, u8, i8) are widened to float32, multiplied by the scale in
float32 and cast to the output dtype; the others are cast directly.  The scale
is ``ple.formats.applied_scale``'s, so a scale rounded to the output dtype gives
torch's ``values.to(dtype) * scale.to(dtype)`` as well (torch too multiplies
float16 and bfloat16 in float32 and rounds once).  The product is not fused
with anything, so no FMA can change its rounding.

The kernel must also run on V100 (SM70) and Turing (SM75), so it uses no fp8
Triton type (refused below SM89) and decodes FP8 E4M3FN bits with integer
operations.

Only imported where triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple.formats import OUTPUT_DTYPES, RowFormat


@triton.jit
def fp8e4m3fn_bits_to_f32(b):
    """FP8 E4M3FN bytes to float32, exactly as torch.float8_e4m3fn converts them
    (bits included: NaN comes out as sign | 0x7FF00000, like c10's conversion)."""
    b = b.to(tl.uint32)
    sign = (b >> 7) << 31
    exp = (b >> 3) & 15
    mant = b & 7
    normal = sign | ((exp + 120) << 23) | (mant << 20)  # rebias 7 -> 127, 3 -> 23 mantissa bits
    # e == 0: m * 2^-9, exact in float32; the sign goes on by bits so 0x80 gives -0.0.
    subnormal = (mant.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True) | sign
    bits = tl.where(exp == 0, subnormal, normal)
    bits = tl.where((b & 0x7F) == 0x7F, sign | 0x7FF00000, bits)  # no infinities; e=15, m=7 is NaN
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_rne(x):
    """float32 to bfloat16 rounded as torch rounds (c10::BFloat16's
    round_to_nearest_even); NaN -> 0x7FC0, c10's scalar NaN (torch's vectorized
    CPU cast writes 0xFFFF: NaN bits are not compared across devices).
    Written with integer operations because the interpreter's float32 ->
    bfloat16 cast truncates instead of rounding, and SM70/75 have no bf16
    conversion instruction anyway."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def decode_rows_kernel(
    staged_ptr,  # *u8 [n, row_bytes]; device memory, or pinned host memory read over UVA
    status_ptr,  # *i32, one word: nonzero when the host gather that filled staged failed
    out_ptr,  # *fp32 | *fp16 | *bf16 [n, cols]; its element type is the output dtype (compile-time)
    cols,
    row_bytes,
    scale,  # fp32; used by the scaled formats only
    FMT: tl.constexpr,  # RowFormat.name
    BLOCK: tl.constexpr,
):
    # Grid: (rows, column blocks).  Row offsets in int64: row * row_bytes and
    # row * cols pass 2^31 on large tables.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    src = staged_ptr + row * row_bytes
    OUT: tl.constexpr = out_ptr.dtype.element_ty

    if FMT == "f32":
        v = tl.load(src.to(tl.pointer_type(tl.float32)) + offs, mask=mask)
    elif FMT == "f16":
        v = tl.load(src.to(tl.pointer_type(tl.float16)) + offs, mask=mask)
    elif FMT == "bf16":
        # Loaded as bits and widened by a shift: exact for every pattern (the
        # interpreter's bf16 -> f32 cast loses subnormals).
        bits = tl.load(src.to(tl.pointer_type(tl.uint16)) + offs, mask=mask)
        if OUT == tl.bfloat16:
            v = bits.to(tl.bfloat16, bitcast=True)
        else:
            v = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif FMT == "fp8_e4m3fn":
        v = fp8e4m3fn_bits_to_f32(tl.load(src + offs, mask=mask)) * scale
    elif FMT == "u8":
        v = tl.load(src + offs, mask=mask).to(tl.float32) * scale
    else:  # "i8"
        v = tl.load(src.to(tl.pointer_type(tl.int8)) + offs, mask=mask).to(tl.float32) * scale

    if v.dtype == OUT:
        out = v  # same type: the bits pass through, as torch's .to() does
    elif OUT == tl.bfloat16:
        out = f32_to_bf16_rne(v.to(tl.float32))  # f16 -> f32 is exact; torch goes through float too
    else:
        out = v.to(OUT)  # f32 <-> f16 (round to nearest even), bf16-as-f32 -> f16
    # A failed gather leaves stale bytes in staged: write NaN, never old rows.
    failed = tl.load(status_ptr) != 0
    out = tl.where(failed, tl.full([BLOCK], float("nan"), tl.float32).to(OUT), out)
    tl.store(out_ptr + row * cols + offs, out, mask=mask)


FORMAT_NAMES = ("f32", "f16", "bf16", "fp8_e4m3fn", "u8", "i8")
MAX_BLOCK = 1024


def check_and_grid(staged: torch.Tensor, fmt: RowFormat, out: torch.Tensor
                   ) -> tuple[int, tuple[int, int]]:
    """Checks that ``staged`` (contiguous uint8 ``[n, row_bytes]``) holds
    ``fmt`` rows of ``out`` (contiguous ``[n, cols]`` float32/float16/
    bfloat16); returns the column block and the grid of a row decoder
    (the grid is empty when there is nothing to decode)."""
    if out.dtype not in OUTPUT_DTYPES:
        raise ValueError(f"unsupported output dtype {out.dtype}")
    if staged.dtype != torch.uint8 or staged.dim() != 2 or not staged.is_contiguous():
        raise ValueError("staged must be a contiguous uint8 [n, row_bytes] tensor")
    if out.dim() != 2 or not out.is_contiguous():
        raise ValueError("out must be a contiguous [n, cols] tensor")
    n, row_bytes = staged.shape
    cols = out.shape[1]
    whole_blocks = not fmt.is_block or cols % fmt.block_size == 0
    if out.shape[0] != n or not whole_blocks or row_bytes != fmt.row_bytes(cols):
        raise ValueError(f"staged {tuple(staged.shape)} does not hold {fmt.name} rows of out {tuple(out.shape)}")
    block = min(MAX_BLOCK, triton.next_power_of_2(max(cols, 1)))
    # Rows on axis 0 (up to 2^31 - 1), column blocks on axis 1 (<= 65535).
    return block, (n, triton.cdiv(cols, block))


def launch_decoder(kernel, staged: torch.Tensor, fmt: RowFormat, out: torch.Tensor,
                   status: torch.Tensor | None, *args, **meta) -> torch.Tensor:
    """Launches a row decoder ``kernel(staged, status, out, cols, row_bytes,
    *args, FMT=, BLOCK=, **meta)`` over ``out`` after check_and_grid; a
    missing ``status`` is a zero word.  Returns ``out``."""
    block, grid = check_and_grid(staged, fmt, out)
    if 0 in grid:
        return out
    if status is None:
        status = torch.zeros(1, dtype=torch.int32, device=staged.device)
    kernel[grid](staged, status, out, out.shape[1], staged.shape[1], *args, FMT=fmt.name,
                 BLOCK=block, **meta)
    return out


def decode_rows_triton(staged: torch.Tensor, fmt: RowFormat, scale: float, out: torch.Tensor,
                       status: torch.Tensor | None = None) -> torch.Tensor:
    """Decode staged row ``i`` (uint8 ``[n, row_bytes]``, contiguous) into
    ``out[i]`` (``[n, cols]`` float32/float16/bfloat16, contiguous); returns ``out``.
    ``status``: an int32 word; when it is nonzero at run time every value is NaN."""
    if fmt.name not in FORMAT_NAMES:
        raise ValueError(f"no Triton decoder for row format {fmt.name!r}")
    return launch_decoder(decode_rows_kernel, staged, fmt, out, status, float(scale))
