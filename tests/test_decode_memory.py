"""The CPU decoder's memory: a conversion that needs a float32 intermediate
(scaled rows to float16 or bfloat16, GGUF blocks) decodes a chunk of rows at a
time, so that its peak stays near the output's size; before, a float32 copy
of the whole request (and its scaled copy) came first: 5,000,000 u8 rows to
bfloat16 peaked at 2,141 MiB for a 610 MiB output.  The bits are the same
(also tests/test_decode_values.py).  README "Reliability"."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import REPO, bits
from ple.formats import BLOCK_FORMATS, FORMATS, VALUE_FORMATS
from ple.kernels import decode

MiB = 1 << 20

# In a child, so that the peak is this decode's: VmHWM (the peak resident set)
# is reset through /proc/self/clear_refs, and the output is measured against
# the resident set just before the decode.
SCRIPT = r"""
import json, sys
import numpy as np, torch
from ple.formats import BLOCK_FORMATS, FORMATS, VALUE_FORMATS
from ple.kernels.decode import decode_rows

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

rows, cols = 1 << 19, 64
u8 = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (rows, cols), dtype=np.uint8))
blocks = np.zeros((1 << 16, 8, 34), dtype=np.uint8)  # Q8_0: f16 scale, 32 int8 values
blocks[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
blocks[:, :, 2:] = np.random.default_rng(1).integers(0, 256, (1 << 16, 8, 32), dtype=np.uint8)
q8_0 = torch.from_numpy(blocks.reshape(1 << 16, 272))
cases = {"u8 to bfloat16": (u8, FORMATS["u8"], 0.5, torch.bfloat16),
         "fp8 to float16": (u8, FORMATS["fp8_e4m3fn"], 0.25, torch.float16),
         "u8 to float32": (u8, FORMATS["u8"], 0.5, torch.float32),
         "q8_0 to bfloat16": (q8_0, BLOCK_FORMATS["q8_0"], 1.0, torch.bfloat16)}
decode_rows(u8[:4096], FORMATS["u8"], 0.5, torch.bfloat16)  # torch's threads, allocator arenas
result = {}
for name, (raw, fmt, scale, dtype) in cases.items():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    out = decode_rows(raw, fmt, scale, dtype)
    result[name] = [status("VmHWM") - before, out.numel() * out.element_size()]
    del out
print(json.dumps(result))
"""


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _can_reset_peak(), reason="needs /proc/self/clear_refs (Linux)")
def test_peak_memory_stays_near_the_output():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (peak, output) in result.items():
        # Before: 4x the output for u8 and fp8 to 16 bits (a float32 copy and
        # its scaled copy), 2x for float32, 3.4x for Q8_0.  Now the output and
        # a chunk of a few MiB.
        assert peak <= 1.25 * output + 8 * MiB, (
            f"{name}: decoding {output / MiB:.0f} MiB of output peaked {peak / MiB:.0f} MiB higher")


def _reference(raw: torch.Tensor, fmt, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The decoder before chunks: the whole request at once."""
    values = raw.view(fmt.storage)
    if fmt.scaled:
        values = values.to(torch.float32)
        if scale != 1.0:
            values = values * scale
    return values.to(dtype)


@pytest.mark.parametrize("fmt", ["u8", "i8", "fp8_e4m3fn", "q8_0", "q4_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_chunks_give_the_same_bits(monkeypatch, fmt, dtype):
    """Chunks of a few rows (a chunk of 100 values), rows counts that do and
    do not divide into them: the bits of the whole request decoded at once."""
    monkeypatch.setattr(decode, "CHUNK_VALUES", 100)
    rng = np.random.default_rng(7)
    if fmt in VALUE_FORMATS:
        f = VALUE_FORMATS[fmt]
        raw = torch.from_numpy(rng.integers(0, 256, (2, 37, 48), dtype=np.uint8))
        want = _reference(raw, f, 0.37, dtype)
        scale = 0.37
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        f = BLOCK_FORMATS[fmt]
        raw_np = rng.integers(0, 256, (37, 2 * f.block_bytes), dtype=np.uint8)
        for block in (0, f.block_bytes):  # finite f16 scales: first (Q8_0, Q4_K's d and
            # dmin) and last (Q6_K's d) bytes of each block
            raw_np[:, block:block + 4] = raw_np[:, block + f.block_bytes - 2:block + f.block_bytes] = 0x10
        raw = torch.from_numpy(raw_np)
        want = torch.from_numpy(dequantize(raw_np, GGMLQuantizationType(f.gguf_type))).to(dtype)
        scale = 1.0
    got = decode.decode_rows(raw, f, scale, dtype)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(bits(got), bits(want))
