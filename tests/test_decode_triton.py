"""The Triton row decoder (kernels/decode_triton.py), without a GPU.

* Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors): bit-identical to
  the CPU decoder ``decode_rows`` for every row format, output dtype and scale.
* Compiled with ``triton.compile`` for sm_70, sm_75, sm_80 and sm_90 (in a
  subprocess without TRITON_INTERPRET): PTX and cubin come out, and the PTX has
  no fp8 or bf16 conversion instruction (the kernel must run on V100 and Turing).

TRITON_INTERPRET is read when ``@triton.jit`` decorates a function, so the
interpreted copy of the kernel module is loaded privately with the variable set
for the load only (helpers.load_interpreted): other modules' kernels stay
compiled.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import ple.kernels  # noqa: E402
from ple.formats import FORMATS, OUTPUT_DTYPES  # noqa: E402
from ple.kernels.decode import decode_rows  # noqa: E402
from helpers import (COMPILE_CCS, OUT_SIGNATURE, assert_runs_on_old_gpus, assert_same_bits_but_nan,  # noqa: E402
                     compile_for_targets, dtype_id, load_interpreted)

KERNEL_FILE = Path(ple.kernels.__path__[0]) / "decode_triton.py"
FORMAT_NAMES = ("f32", "f16", "bf16", "fp8_e4m3fn", "u8", "i8")
COLS = (1, 17, 160, 1000)
@pytest.fixture(scope="module")
def interp():
    """The kernel module with its kernels interpreted (helpers.load_interpreted)."""
    mod = load_interpreted(KERNEL_FILE)
    assert type(mod.decode_rows_kernel).__name__ == "InterpretedFunction"
    assert type(mod.call_row).__name__ == "InterpretedFunction"
    return mod


# --- staged bytes ---------------------------------------------------------------

F32_SPECIAL_BITS = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,  # 0, -0, inf, nan
    0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,  # subnormals, min normal, max finite
    0x7F7F8000, 0x7F7F7FFF,  # bf16 rounding to inf / to max finite
    0x3F808000, 0x3F818000, 0x3F808001, 0xBF817FFF,  # bf16 ties to even and off-tie
    0x477FE000, 0x477FF000, 0x477FEFFF, 0xC77FF000,  # 65504, 65520 (f16: inf), just below, -65520
    0x33800000, 0x33000000, 0x33000001, 0x387FC000, 0xB3C00000,  # f16 subnormal edges, ties
    0x3F800000, 0xBF800000,
]
HALF_SPECIAL_BITS = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x0001, 0x83FF, 0x0400, 0x7BFF,
                     0xFBFF, 0x3C00, 0xBC00, 0x7F80, 0xFF80, 0x7FC0, 0x7F7F, 0x0080, 0x007F, 0x3F80]


def staged_bytes(name: str, cols: int, seed: int) -> torch.Tensor:
    """uint8 ``[n, cols * itemsize]``: all 256 byte patterns for the 1-byte
    formats, random bit patterns with inf/nan/-0/subnormals/rounding edges for
    the floats."""
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(seed)
    rows = max(2, math.ceil(256 / cols))
    n = rows * cols
    if fmt.itemsize == 1:
        bits = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        bits[:256] = torch.arange(256, dtype=torch.uint8)
    elif fmt.itemsize == 2:
        bits = torch.randint(-2**15, 2**15, (n,), generator=gen, dtype=torch.int32)
        specials = torch.tensor(HALF_SPECIAL_BITS, dtype=torch.int32)
        bits[: len(specials)] = specials
        bits = bits.to(torch.int16)  # wraps: the high patterns become negative int16
    else:
        bits = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64)
        specials = torch.tensor(F32_SPECIAL_BITS, dtype=torch.int64)
        bits[: len(specials)] = specials
        bits = ((bits + 2**31) % 2**32 - 2**31).to(torch.int32)
    return bits.view(torch.uint8).reshape(rows, cols * fmt.itemsize).contiguous()


def decode_cases():
    for name in FORMAT_NAMES:
        for dtype in OUTPUT_DTYPES:
            for scale in ((1.0, 0.37) if FORMATS[name].scaled else (1.0,)):
                for cols in COLS:
                    yield pytest.param(name, dtype, scale, cols, id=f"{name}-{dtype_id(dtype)}-s{scale}-c{cols}")


# --- interpreter: values ----------------------------------------------------------

@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's f32 -> f16 cast to inf
@pytest.mark.parametrize("name, dtype, scale, cols", list(decode_cases()))
def test_matches_cpu_decoder(interp, name, dtype, scale, cols):
    fmt = FORMATS[name]
    staged = staged_bytes(name, cols, seed=cols)
    n = staged.shape[0]
    # One guard row past the output: a store outside the mask would show there.
    buf = torch.full((n + 1, cols), 1234.0, dtype=dtype)
    out = buf[:n]
    assert interp.decode_rows_triton(staged, fmt, scale, out) is out
    assert_same_bits_but_nan(out, decode_rows(staged, fmt, scale, dtype))
    assert (buf[n] == 1234.0).all()


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_zero_rows(interp, name, dtype):
    fmt = FORMATS[name]
    staged = torch.empty(0, 17 * fmt.itemsize, dtype=torch.uint8)
    out = torch.empty(0, 17, dtype=dtype)
    assert interp.decode_rows_triton(staged, fmt, 0.37, out) is out
    assert_same_bits_but_nan(out, decode_rows(staged, fmt, 0.37, dtype))


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
def test_failed_status_gives_nan_rows(interp, dtype):
    fmt = FORMATS["fp8_e4m3fn"]
    staged = staged_bytes("fp8_e4m3fn", 17, seed=3)
    out = torch.zeros(staged.shape[0], 17, dtype=dtype)
    interp.decode_rows_triton(staged, fmt, 1.0, out, status=torch.ones(1, dtype=torch.int32))
    assert out.isnan().all()


def test_rejects_mismatched_shapes(interp):
    staged = torch.zeros(3, 17 * 2, dtype=torch.uint8)
    with pytest.raises(ValueError):
        interp.decode_rows_triton(staged, FORMATS["f32"], 1.0, torch.empty(3, 17))
    with pytest.raises(ValueError):
        interp.decode_rows_triton(staged, FORMATS["f16"], 1.0, torch.empty(3, 17, dtype=torch.float64))


# --- interpreter: the FP8 integer decode alone -----------------------------------

def _fp8_probe(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, fp8e4m3fn_bits_to_f32(tl.load(src_ptr + offs)))  # noqa: F821 (set below)


def test_fp8_integer_decode_all_patterns(interp, monkeypatch):
    globals()["fp8e4m3fn_bits_to_f32"] = interp.fp8e4m3fn_bits_to_f32
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    probe = triton.jit(_fp8_probe)  # decorated while TRITON_INTERPRET=1: interpreted
    src = torch.arange(256, dtype=torch.uint8)
    dst = torch.empty(256, dtype=torch.float32)
    probe[(1,)](src, dst, BLOCK=256)
    ref = src.view(torch.float8_e4m3fn).to(torch.float32)
    assert int(ref.isnan().sum()) == 2 and int(dst.isnan().sum()) == 2
    assert torch.equal(dst.view(torch.int32), ref.view(torch.int32))  # NaN bits and -0.0 included


# --- compilation for SM70, SM75, SM80, SM90 without a GPU ------------------------


COMPILE_SCRIPT = r"""
from ple.kernels.decode_triton import decode_rows_kernel, MAX_BLOCK
assert type(decode_rows_kernel).__name__ == "JITFunction"
results = {}
for cc in json.loads(sys.argv[1]):
    for fmt in json.loads(sys.argv[2]):
        for out in json.loads(sys.argv[3]):
            signature = {"rows_ptr": "*u8", "status_ptr": "*i32", "out_ptr": "*" + out, "cols": "i32",
                         "row_bytes": "i32", **NO_TIERS_SIGNATURE, "scale": "fp32", "FMT": "constexpr",
                         "BLOCK": "constexpr", **{name: "constexpr" for name in NO_TIERS_CONSTEXPRS}}
            src = triton.compiler.ASTSource(fn=decode_rows_kernel, signature=signature,
                                            constexprs={"FMT": fmt, "BLOCK": MAX_BLOCK, **NO_TIERS_CONSTEXPRS})
            results[f"{cc}-{fmt}-{out}"] = compile_summary(src, cc)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every (target, format, output dtype) compiled in one subprocess."""
    return compile_for_targets(COMPILE_SCRIPT, FORMAT_NAMES, tmp_path_factory.mktemp("triton-cache"))


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("cc", COMPILE_CCS, ids=lambda cc: f"sm_{cc}")
def test_compiles_for_target(compiled, cc, name, dtype):
    result = compiled[f"{cc}-{name}-{OUT_SIGNATURE[dtype]}"]
    assert_runs_on_old_gpus(result, cc)
