"""The GPU decoder of GGUF's grid i-quants: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS and IQ3_S, super-blocks of 256 values, in one Triton kernel
specialized by ``FMT`` (kernels/decode_gguf_triton.py's
``decode_blocks_triton`` launches it; kernels/gguf_bits_triton.py says what
the decoders share and why they are bit-identical to
``gguf.quants.dequantize``).

A block stores, for each group of 4 or 8 values, the index of an entry of
its format's grid (ple/gguf_grids.py); a value is its grid value times its
sub-block's scale, and, for IQ2 and IQ3, times its sign (a bit of its own,
or one of 7 bits per group of 8 whose parity is the eighth); IQ1 adds a
signed offset of 1/8 to the grid value first.  The kernel reads the grid
from a device copy (``grid_on``), one table a grid.

Every operation is exact in float32 (an f16 scale's 11 significant bits, a
sub-block scale of at most 5 and a grid value of at most 6 (IQ1: the grid
value plus the offset, 4) make at most 22), as gguf's are, so the values are
gguf's whatever the order; the kernel keeps gguf's order anyway.

Only imported where triton is available.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from ple.formats import RowFormat
from ple.gguf_grids import GRID_OF_FORMAT, format_grid
from ple.kernels.decode_triton import launch_decoder
from ple.kernels.gguf_bits_triton import LAUNCH_OPTIONS, f16_at, store_values, u8_at, u16_at
from ple.kernels.tier_rows_triton import TierRead, call_row


@triton.jit
def u32_bits_at(ptr, mask):
    """The bits of the little-endian uint32 at byte address ``ptr``, as int32."""
    return u16_at(ptr, mask) | (u16_at(ptr + 2, mask) << 16)


@triton.jit
def ksigns_bit(index, bit):
    """Bit ``bit`` (0..7) of gguf's ``ksigns[index]`` (index 0..127): the
    index's 7 bits, and their parity as bit 7, so that every group of 8 has
    an even number of minus signs."""
    parity = index ^ (index >> 4)
    parity = parity ^ (parity >> 2)
    parity = (parity ^ (parity >> 1)) & 1
    return ((index | (parity << 7)) >> bit) & 1


@triton.jit
def sign_factor(bit):
    """gguf's sign factor of a sign bit: -1.0 where it is set, else 1.0."""
    return tl.where(bit == 0, 1.0, -1.0)


@triton.jit
def decode_iq_blocks_kernel(
    rows_ptr,  # *u8 [n, row_bytes]: the staged rows (device memory, or pinned host memory: UVA)
    status_ptr,  # *i32, one word: nonzero when the call failed (HAS_STATUS)
    out_ptr,  # *fp32 | *fp16 | *bf16 [n, cols]; its element type is the output dtype (compile-time)
    cols,
    row_bytes,
    # Where each row lies with tiers: tier_rows_triton.call_row.
    ids_ptr, device_ptr, host_ptr, first_row, device_rows, tier_rows, num_rows, hits_ptr,
    report_ptr,
    grid_ptr,  # *i8 [entries, W]: the format's grid (grid_on)
    FMT: tl.constexpr,  # RowFormat.name of one of IQ_FORMAT_NAMES
    BLOCK: tl.constexpr,
    TIERS: tl.constexpr,
    HAS_STATUS: tl.constexpr,
    SCAN_IDS: tl.constexpr,
    BB: tl.constexpr,  # bytes per block (RowFormat.block_bytes)
):
    src, failed = call_row(rows_ptr, status_ptr, row_bytes, ids_ptr, device_ptr, host_ptr,
                           first_row, device_rows, tier_rows, num_rows, hits_ptr, report_ptr, TIERS,
                           HAS_STATUS, SCAN_IDS)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # A failed call reads nothing (decode_triton.py says why, and why a bound).
    mask = offs < tl.where(failed, 0, cols)
    blk = src + (offs // 256) * BB  # this lane's super-block
    k = offs % 256  # this lane's value within it
    s = k // 32  # its sub-block of 32 values
    j = k // 8  # its group of 8 values

    if FMT == "iq3_xxs" or FMT == "iq3_s":
        W: tl.constexpr = 4  # values per grid entry
    else:
        W: tl.constexpr = 8

    if FMT == "iq2_xxs" or FMT == "iq3_xxs":
        # d: f16.  IQ2_XXS: per sub-block 8 bytes, the 4 grid indices of its
        # groups, then a uint32 aux.  IQ3_XXS: 64 bytes of grid indices (one per
        # 4 values), then one uint32 aux per sub-block.  aux: the 7 sign bits of
        # group g at bit 7g, the sub-block scale in the top 4 bits.
        # gguf: (d * (0.5 + scale) * 0.25 (IQ3_XXS: 0.5)) * grid * sign.
        if FMT == "iq2_xxs":
            entry = u8_at(blk + 2 + s * 8 + (k % 32) // 8, mask)
            aux = u32_bits_at(blk + 2 + s * 8 + 4, mask)
            FACTOR: tl.constexpr = 0.25
        else:
            entry = u8_at(blk + 2 + k // 4, mask)
            aux = u32_bits_at(blk + 66 + s * 4, mask)
            FACTOR: tl.constexpr = 0.5
        scale = 0.5 + ((aux >> 28) & 15).to(tl.float32)
        negative = ksigns_bit((aux >> (((k % 32) // 8) * 7)) & 127, k % 8)
        db = (f16_at(blk, mask) * scale) * FACTOR
    elif FMT == "iq2_xs" or FMT == "iq2_s":
        # d: f16; then the 4-bit scales of the 16-value halves of the
        # sub-blocks, nibble (k // 16) % 2 of byte s (IQ2_XS at 66, IQ2_S at 74).
        # IQ2_XS: a uint16 per group, the grid index in its low 9 bits, a ksigns
        # index in its top 7.  IQ2_S: a byte per group, the low 8 bits of its
        # grid index (whose top 2 bits are bit pair j % 4 of byte 66 + s), and a
        # sign bit per value from byte 34.
        # gguf: (d * (0.5 + scale) * 0.25) * grid * sign.
        if FMT == "iq2_xs":
            packed = u16_at(blk + 2 + j * 2, mask)
            entry = packed & 511
            negative = ksigns_bit(packed >> 9, k % 8)
            SCALES: tl.constexpr = 66
        else:
            top = (u8_at(blk + 66 + s, mask) >> ((j % 4) * 2)) & 3
            entry = u8_at(blk + 2 + j, mask) | (top << 8)
            negative = (u8_at(blk + 34 + j, mask) >> (k % 8)) & 1
            SCALES: tl.constexpr = 74
        nibble = (u8_at(blk + SCALES + s, mask) >> (((k // 16) % 2) * 4)) & 15
        db = (f16_at(blk, mask) * (0.5 + nibble.to(tl.float32))) * 0.25
    elif FMT == "iq3_s":
        # d: f16; 64 bytes, the low 8 bits of the grid indices (one per 4
        # values), whose ninth bits are in 8 bytes from 66; a sign bit per value
        # from byte 74; the 4-bit sub-block scales, nibble s % 2 of byte 106 + s // 2.
        # gguf: (d * (1 + 2 * scale)) * grid * sign.
        g4 = k // 4
        top = (u8_at(blk + 66 + g4 // 8, mask) >> (g4 % 8)) & 1
        entry = u8_at(blk + 2 + g4, mask) | (top << 8)
        negative = (u8_at(blk + 74 + j, mask) >> (k % 8)) & 1
        nibble = (u8_at(blk + 106 + s // 2, mask) >> ((s % 2) * 4)) & 15
        db = f16_at(blk, mask) * (1 + 2 * nibble).to(tl.float32)
    elif FMT == "iq1_s":
        # d: f16; 32 bytes, the low 8 bits of the grid indices (one per group);
        # a uint16 per sub-block: the top 3 bits of its groups' indices (bits
        # 3g..3g+2 for group g), its 3-bit scale (bits 12-14) and the sign of its
        # offset (bit 15).  gguf: (d * (2 * scale + 1)) * (grid + offset).
        high = u16_at(blk + 34 + s * 2, mask)
        entry = u8_at(blk + 2 + j, mask) | (((high >> ((j % 4) * 3)) & 7) << 8)
        offset = tl.where((high & 0x8000) == 0, 0.125, -0.125)
        db = f16_at(blk, mask) * (2 * ((high >> 12) & 7) + 1).to(tl.float32)
    else:  # "iq1_m"
        # 32 bytes, the low 8 bits of the grid indices; 16 bytes of a nibble per
        # group, the top 3 bits of its index and the sign of its offset (bit 3);
        # 4 uint16: four 3-bit scales of 16-value halves each (bits 3t..3t+2 for
        # half 4w + t), and d, an f16 in their top 4 bits (its low nibble in the
        # first).  gguf: (d * (2 * scale + 1)) * (grid + offset).
        nib = (u8_at(blk + 32 + j // 2, mask) >> ((j % 2) * 4)) & 15
        entry = u8_at(blk + j, mask) | ((nib & 7) << 8)
        offset = tl.where((nib & 8) == 0, 0.125, -0.125)
        d_bits = ((u8_at(blk + 49, mask) >> 4) | ((u8_at(blk + 51, mask) >> 4) << 4)
                  | ((u8_at(blk + 53, mask) >> 4) << 8) | ((u8_at(blk + 55, mask) >> 4) << 12))
        d = d_bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        half = k // 16
        scale = (u16_at(blk + 48 + (half // 4) * 2, mask) >> ((half % 4) * 3)) & 7
        db = d * (2 * scale + 1).to(tl.float32)

    value = tl.load(grid_ptr + entry * W + k % W, mask=mask).to(tl.float32)
    if FMT == "iq1_s" or FMT == "iq1_m":
        v = db * (value + offset)
    else:
        v = (db * value) * sign_factor(negative)

    store_values(out_ptr, row, cols, offs, v, failed, BLOCK)


IQ_FORMAT_NAMES = tuple(GRID_OF_FORMAT)

_grids: dict[tuple[str, torch.device], torch.Tensor] = {}
_grids_lock = threading.Lock()


def grid_on(fmt: RowFormat, device: torch.device) -> torch.Tensor:
    """The grid of ``fmt`` as a flat int8 tensor on ``device``, copied there
    at its first use and kept: one copy a grid and device (IQ1_M shares
    IQ1_S's).  A copy from the host cannot be captured in a CUDA graph, so a
    first use there while a graph is being captured is an error."""
    key = (GRID_OF_FORMAT[fmt.name], device)
    table = _grids.get(key)
    if table is not None:
        return table
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"ple: the first {fmt.name} decode on {device} copies its grid there, "
                           f"which CUDA graph capture forbids: gather from the table once on "
                           f"{device} before capturing")
    with _grids_lock:
        if key not in _grids:
            table = torch.from_numpy(format_grid(fmt.name).copy()).reshape(-1).to(device)
            if device.type == "cuda":
                # Every stream may read it from now on, not only the one that copied it.
                torch.cuda.current_stream(device).synchronize()
            _grids[key] = table
        return _grids[key]


def decode_iq_blocks_triton(staged: torch.Tensor | None, fmt: RowFormat, scale: float,
                            out: torch.Tensor, status: torch.Tensor | None = None,
                            tiers: TierRead | None = None) -> torch.Tensor:
    """``decode_blocks_triton`` of a format in IQ_FORMAT_NAMES."""
    if fmt.name not in IQ_FORMAT_NAMES:
        raise ValueError(f"no Triton grid decoder for row format {fmt.name!r}")
    return launch_decoder(decode_iq_blocks_kernel, staged, fmt, out, status, tiers,
                          grid_on(fmt, out.device), BB=fmt.block_bytes, **LAUNCH_OPTIONS)
