"""The GPU row decoder: staged row bytes to values, in one Triton kernel.
With tiers the kernel reads each row where it lies instead, the device tier,
the host tier or the staged rows (kernels/tier_rows_triton.py's ``call_row``,
which kernels/decode_gguf_triton.py calls too).

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

import functools

import torch
import triton
import triton.language as tl

from ple.formats import OUTPUT_DTYPES, RowFormat
from ple.kernels.launch_cache import LaunchCache
from ple.kernels.tier_rows_triton import TierRead, call_row


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
    rows_ptr,  # *u8 [n, row_bytes]: the staged rows; device memory, or pinned host memory read over UVA
    status_ptr,  # *i32, one word: nonzero when the call failed (HAS_STATUS)
    out_ptr,  # *fp32 | *fp16 | *bf16 [n, cols]; its element type is the output dtype (compile-time)
    cols,
    row_bytes,
    # Where each row lies with tiers: tier_rows_triton.call_row.
    ids_ptr, device_ptr, host_ptr, first_row, device_rows, tier_rows, num_rows, hits_ptr, report_ptr,
    scale,  # fp32; used by the scaled formats only
    FMT: tl.constexpr,  # RowFormat.name
    BLOCK: tl.constexpr,
    TIERS: tl.constexpr,
    HAS_STATUS: tl.constexpr,
    SCAN_IDS: tl.constexpr,
):
    # Grid: (rows, column blocks).  Row offsets in int64: row * row_bytes and
    # row * cols pass 2^31 on large tables.
    src, failed = call_row(rows_ptr, status_ptr, row_bytes, ids_ptr, device_ptr, host_ptr, first_row,
                           device_rows, tier_rows, num_rows, hits_ptr, report_ptr, TIERS, HAS_STATUS,
                           SCAN_IDS)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < cols
    # A failed call reads nothing: its staged bytes may be stale, and a bad
    # id's row is nowhere.  (A bound, not in_row & ~failed: the interpreter
    # mistypes a scalar bool broadcast into a mask.)
    mask = offs < tl.where(failed, 0, cols)
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
    out = tl.where(failed, tl.full([BLOCK], float("nan"), tl.float32).to(OUT), out)
    tl.store(out_ptr + row * cols + offs, out, mask=in_row)


FORMAT_NAMES = ("f32", "f16", "bf16", "fp8_e4m3fn", "u8", "i8")
MAX_BLOCK = 1024


@functools.cache
def row_layout(fmt: RowFormat, dtype: torch.dtype, cols: int) -> tuple[int, int, int]:
    """``(column block, column blocks, row bytes)`` of a decoder of ``fmt``
    rows into ``cols`` values of ``dtype``, after checking that it can decode
    them.  Cached: a call's checks cost one lookup once a shape has been seen
    (and triton.cdiv and next_power_of_2 take microseconds each)."""
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"unsupported output dtype {dtype}")
    if fmt.is_block and cols % fmt.block_size:
        raise ValueError(f"{cols} values are not whole {fmt.name} blocks of {fmt.block_size}")
    block = min(MAX_BLOCK, triton.next_power_of_2(max(cols, 1)))
    return block, triton.cdiv(cols, block), fmt.row_bytes(cols)


@functools.cache
def _launches(kernel) -> LaunchCache:
    """Each decoder kernel's launches, made at its first."""
    return LaunchCache(kernel)


def without_tiers(placeholder: torch.Tensor) -> tuple:
    """call_row's arguments ``ids_ptr`` to ``report_ptr`` of a call without
    tiers: none is read, so the pointers may be any tensor's."""
    return (placeholder,) * 3 + (0, 0, 0, 0) + (placeholder,) * 2


# The positions of the tensors among a decoder's arguments (staged, status,
# out, and call_row's pointers), for LaunchCache.launch_planned.
DECODER_TENSORS = (0, 1, 2, 5, 6, 7, 12, 13)


def launch_decoder(kernel, staged: torch.Tensor | None, fmt: RowFormat, out: torch.Tensor,
                   status: torch.Tensor | None, tiers: TierRead | None, *args: float, **meta
                   ) -> torch.Tensor:
    """Launches a row decoder ``kernel(staged, status, out, cols, row_bytes,
    <tiers>, *args, FMT=, BLOCK=, TIERS=, HAS_STATUS=, SCAN_IDS=, **meta)``
    over ``out`` (contiguous ``[n, cols]`` float32/float16/bfloat16), each
    row read from ``staged`` (contiguous uint8 ``[n, row_bytes]`` of ``fmt``
    rows) or, with ``tiers``, where ``tiers`` says (then ``staged`` holds
    the rows that are not resident, or is None when every row is).  Every
    value is NaN when ``status`` (an int32 word) is nonzero at run time.
    ``args``: floats; ``meta``: the same for every call of ``kernel`` with
    one ``fmt``.  Returns ``out``."""
    if out.dim() != 2 or not out.is_contiguous():
        raise ValueError("out must be a contiguous [n, cols] tensor")
    n, cols = out.shape
    dtype = out.dtype
    block, column_blocks, row_bytes = row_layout(fmt, dtype, cols)
    if staged is None:
        if tiers is None:
            raise ValueError("without tiers the rows must be staged")
        staged = tiers.unread_rows  # every row is resident
    elif (staged.dtype != torch.uint8 or not staged.is_contiguous()
          or staged.shape != (n, row_bytes)):
        raise ValueError(f"staged {tuple(staged.shape)} {staged.dtype} does not hold {fmt.name} rows "
                         f"of out {tuple(out.shape)} contiguously")
    if n == 0:
        return out
    # Rows on axis 0 (up to 2^31 - 1), column blocks on axis 1 (<= 65535).
    grid = (n, column_blocks, 1)
    # A status word that is not read (HAS_STATUS false) may be any tensor's.
    source = without_tiers(out) if tiers is None else tiers.kernel_args
    device = out.get_device()
    # Everything the launch specializes on but the tensors' addresses: the
    # staged rows are uint8, the status word int32, the placeholders out's
    # dtype; the constexprs follow from these.
    plan = (fmt.name, dtype, cols, status is None, None if tiers is None else tiers.plan,
            len(args), device)
    _launches(kernel).launch_planned(
        plan, DECODER_TENSORS, grid,
        (staged, out if status is None else status, out, cols, row_bytes, *source, *args), device,
        dict(FMT=fmt.name, BLOCK=block, TIERS=tiers is not None, HAS_STATUS=status is not None,
             SCAN_IDS=0 if tiers is None else tiers.scan_ids, **meta))
    return out


def decode_rows_triton(staged: torch.Tensor | None, fmt: RowFormat, scale: float,
                       out: torch.Tensor, status: torch.Tensor | None = None,
                       tiers: TierRead | None = None) -> torch.Tensor:
    """Decode staged row ``i`` (uint8 ``[n, row_bytes]``, contiguous) into
    ``out[i]`` (``[n, cols]`` float32/float16/bfloat16, contiguous); returns ``out``.
    ``status``: an int32 word; when it is nonzero at run time every value is NaN.
    ``tiers``: read each row where it lies instead (``launch_decoder``)."""
    if fmt.name not in FORMAT_NAMES:
        raise ValueError(f"no Triton decoder for row format {fmt.name!r}")
    return launch_decoder(decode_rows_kernel, staged, fmt, out, status, tiers, float(scale))
