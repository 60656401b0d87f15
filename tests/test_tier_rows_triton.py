"""Rows read where they lie (kernels/tier_rows_triton.py) by both decoders,
under Triton's interpreter, on CPU tensors: each row from the device tier,
the host tier or the staged disk rows, decoded to the bits of a decode of
the same rows staged; hits counted; a bad id (every id checked by each
program, or by check_ids_kernel for a larger call) or a failed host gather
make the whole call NaN, and a bad id sets the report word, which a good
call does not clear.  The variants the operator launches compile for old
GPUs too (as in test_decode_triton.py).

The kernel modules are loaded privately with TRITON_INTERPRET set for the
load only (helpers.load_interpreted): the CUDA operator's own copies stay
compiled.  On CPU the "device tier" is a CPU tensor too: the kernels see
only addresses.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import ple.kernels
from ple.formats import FORMATS
from ple.tiers import Tiers
from helpers import (COMPILE_CCS, assert_runs_on_old_gpus, assert_same_bits_but_nan, compile_in_subprocess,
                     load_interpreted)

KERNELS = Path(ple.kernels.__path__[0])
NUM_ROWS = 100


@pytest.fixture(scope="module")
def interpreted():
    """The tier module and both decoders, their kernels interpreted; the
    decoders import the interpreted tier module."""
    pytest.importorskip("triton")
    rows = load_interpreted(KERNELS / "decode_triton.py")
    blocks = load_interpreted(KERNELS / "decode_gguf_triton.py")
    tiers = load_interpreted(KERNELS / "tier_rows_triton.py")
    for kernel in (rows.decode_rows_kernel, blocks.decode_blocks_kernel, tiers.call_row,
                   tiers.check_ids_kernel):
        assert type(kernel).__name__ == "InterpretedFunction"
    return SimpleNamespace(tiers=tiers, rows=rows, blocks=blocks)


def decoder(interpreted, name: str):
    fmt = FORMATS[name]
    return fmt, (interpreted.blocks.decode_blocks_triton if fmt.is_block
                 else interpreted.rows.decode_rows_triton)


def random_table(row_bytes: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (NUM_ROWS, row_bytes), dtype=np.uint8))


def decode_from_tiers(interpreted, name, table, ids, first_row, device_rows, host_rows,
                      with_disk, dtype=torch.float32, status_value=0, report=None):
    """Decodes the rows ``ids`` of ``table`` (uint8 [NUM_ROWS, row_bytes]) read
    from tiers holding rows [first_row, first_row + device_rows + host_rows),
    the rest staged (``with_disk``, with a status word of ``status_value``)
    or none (every id must then be resident, and ``report`` is given: a
    fresh word when None).  Returns (out, hits, report)."""
    fmt, decode = decoder(interpreted, name)
    end = first_row + device_rows + host_rows
    n = len(ids)
    resident = (ids >= first_row) & (ids < end)
    staged = None
    if with_disk:
        staged = torch.zeros((n, table.shape[1]), dtype=torch.uint8)
        staged[~resident] = table[ids[~resident]]
    report = torch.zeros(1, dtype=torch.int32) if report is None and not with_disk else report
    hits = torch.zeros(2, dtype=torch.int64)
    tier_read = interpreted.tiers.TierRead(
        ids, table[first_row:first_row + device_rows] if device_rows else None,
        table[first_row + device_rows:end] if host_rows else None, first_row, NUM_ROWS, hits,
        None if with_disk else report)
    status = torch.tensor([status_value], dtype=torch.int32) if with_disk else None
    if not with_disk and not tier_read.scan_ids:
        status = interpreted.tiers.check_ids(ids, NUM_ROWS, report)
    cols = table.shape[1] // fmt.block_bytes * fmt.block_size if fmt.is_block else table.shape[1] // fmt.itemsize
    buf = torch.full((n + 1, cols), 1234.0, dtype=dtype)  # a guard row past the output
    out = buf[:n]
    assert decode(staged, fmt, 0.37, out, status=status, tiers=tier_read) is out
    assert (buf[n] == 1234.0).all()
    return out, hits, report


def expected_hits(ids, first_row, device_rows, host_rows) -> list[int]:
    tier_row = ids - first_row
    on_device = (tier_row >= 0) & (tier_row < device_rows)
    on_host = (tier_row >= device_rows) & (tier_row < device_rows + host_rows)
    return [int(on_device.sum()), int(on_host.sum())]


@pytest.mark.parametrize("first_row, device_rows, host_rows, with_disk", [
    (0, 0, 0, True), (0, 30, 0, True), (0, 0, 50, True), (0, 30, 50, True), (0, 40, 60, False),
    (0, 100, 0, False), (0, 0, 100, False), (25, 30, 20, True), (60, 0, 40, True), (20, 80, 0, True)])
@pytest.mark.parametrize("row_bytes", [1, 17, 160, 1500])
def test_each_row_is_read_from_its_source(interpreted, first_row, device_rows, host_rows,
                                          with_disk, row_bytes):
    """u8 rows to float32: each value is its byte, so the output shows where
    every byte was read from."""
    table = random_table(row_bytes, row_bytes + first_row)
    end = first_row + device_rows + host_rows
    rng = np.random.default_rng(row_bytes)
    ids = torch.from_numpy(rng.integers(0, NUM_ROWS, 37) if with_disk
                           else rng.integers(first_row, end, 37))
    if end > first_row:
        ids[:2] = torch.tensor([first_row, end - 1])
    out, hits, report = decode_from_tiers(interpreted, "u8", table, ids, first_row, device_rows,
                                          host_rows, with_disk)
    assert torch.equal(out, table[ids].to(torch.float32) * torch.tensor(0.37))
    assert hits.tolist() == expected_hits(ids, first_row, device_rows, host_rows)
    assert report is None or report.item() == 0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's f32 -> f16 cast to inf
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["fp8_e4m3fn", "f16", "q8_0", "q4_k", "iq2_xxs"])
@pytest.mark.parametrize("with_disk", [True, False])
def test_both_decoders_give_the_bits_of_staged_rows(interpreted, name, dtype, with_disk):
    fmt, decode = decoder(interpreted, name)
    row_bytes = 2 * fmt.block_bytes if fmt.is_block else 24 * fmt.itemsize
    table = random_table(row_bytes, 5)
    # Finite f16 scales (Q8_0's and IQ2_XXS's d, Q4_K's d and dmin): NaN would hide the bits.
    if fmt.is_block:
        for offset in range(4):
            table[:, offset::fmt.block_bytes] = 0x3C
    ids = torch.from_numpy(np.random.default_rng(1).integers(0 if with_disk else 10, NUM_ROWS, 29))
    out, hits, _ = decode_from_tiers(interpreted, name, table, ids, 10, 40, 50, with_disk, dtype)
    staged = table[ids].contiguous()
    expected = decode(staged, fmt, 0.37, torch.empty_like(out))
    assert_same_bits_but_nan(out, expected)
    assert hits.tolist() == expected_hits(ids, 10, 40, 50)


@pytest.mark.parametrize("name", ["u8", "q8_0"])
@pytest.mark.parametrize("bad_id", [NUM_ROWS, -1])
@pytest.mark.parametrize("n", [3, 40, 1100])  # every program checks the ids; check_ids_kernel first
def test_a_bad_id_with_every_row_resident_gives_nan_and_a_report(interpreted, name, bad_id, n):
    fmt = FORMATS[name]
    table = random_table(fmt.block_bytes if fmt.is_block else 8, 2)
    ids = torch.from_numpy(np.random.default_rng(n).integers(0, NUM_ROWS, n))
    ids[n // 2] = bad_id
    out, hits, report = decode_from_tiers(interpreted, name, table, ids, 0, 60, 40, False)
    assert out.isnan().all()
    assert report.item() == 1
    good = ids[torch.arange(n) != n // 2]
    assert hits.tolist() == expected_hits(good, 0, 60, 40)  # the good rows were still read


def test_the_ids_are_checked_by_every_program_up_to_scan_max_ids(interpreted):
    tiers, table = interpreted.tiers, random_table(4, 0)

    def scan_ids(n):
        ids = torch.zeros(n, dtype=torch.int64)
        return tiers.TierRead(ids, table, None, 0, NUM_ROWS, torch.zeros(2, dtype=torch.int64),
                              torch.zeros(1, dtype=torch.int32)).scan_ids

    assert [scan_ids(n) for n in (1, 16, 17, tiers.SCAN_MAX_IDS, tiers.SCAN_MAX_IDS + 1)] == [
        16, 16, 32, tiers.SCAN_MAX_IDS, 0]
    with_host_gather = tiers.TierRead(torch.zeros(3, dtype=torch.int64), table, None, 0, NUM_ROWS,
                                      torch.zeros(2, dtype=torch.int64), None)
    assert with_host_gather.scan_ids == 0  # the host gather checks the ids


@pytest.mark.parametrize("name", ["u8", "q8_0"])
@pytest.mark.parametrize("device_rows, host_rows", [(0, 0), (30, 20)])
def test_a_failed_host_gather_gives_nan(interpreted, name, device_rows, host_rows):
    fmt = FORMATS[name]
    table = random_table(fmt.block_bytes if fmt.is_block else 8, 3)
    ids = torch.from_numpy(np.random.default_rng(4).integers(0, NUM_ROWS, 21))
    out, hits, _ = decode_from_tiers(interpreted, name, table, ids, 0, device_rows, host_rows, True,
                                     status_value=1)
    assert out.isnan().all()
    assert hits.tolist() == expected_hits(ids, 0, device_rows, host_rows)


@pytest.mark.parametrize("n", [2, 1100])
def test_a_good_call_does_not_clear_the_report(interpreted, n):
    table = random_table(8, 6)
    report = torch.zeros(1, dtype=torch.int32)
    good = torch.from_numpy(np.random.default_rng(n).integers(0, NUM_ROWS, n))
    bad = good.clone()
    bad[-1] = NUM_ROWS

    def decode(ids):
        return decode_from_tiers(interpreted, "u8", table, ids, 0, NUM_ROWS, 0, False, report=report)[0]

    assert not decode(good).isnan().any() and report.item() == 0
    assert decode(bad).isnan().all() and report.item() == 1
    assert not decode(good).isnan().any() and report.item() == 1


def test_check_ids_sets_a_new_status_and_the_report(interpreted):
    report = torch.zeros(1, dtype=torch.int32)
    ids = torch.arange(3000) % NUM_ROWS
    assert interpreted.tiers.check_ids(ids, NUM_ROWS, report).item() == 0 and report.item() == 0
    ids[2500] = -5
    assert interpreted.tiers.check_ids(ids, NUM_ROWS, report).item() == 1 and report.item() == 1


@pytest.mark.parametrize("n", [5, 1100])
def test_tiers_read_checks_the_ids_when_no_host_gather_does(interpreted, monkeypatch, n):
    """Tiers.read (ple/tiers.py), on a CPU host tier, with the interpreted
    kernels: a call too large for every program to check its ids gets a
    status word from check_ids; strided ids are read in their order; a call
    with a host gather keeps its own status word."""
    monkeypatch.setitem(sys.modules, "ple.kernels.tier_rows_triton", interpreted.tiers)
    table = random_table(8, 7)

    def read_rows(ids, out):
        out.copy_(table[ids])

    tiers = Tiers(read_rows, 8, 0, NUM_ROWS, None)  # pinned where CUDA is: freed below
    try:
        check_reads_of(tiers, table, n, interpreted)
    finally:
        tiers.free()


def check_reads_of(tiers, table, n: int, interpreted) -> None:
    ids = torch.from_numpy(np.random.default_rng(n).integers(0, NUM_ROWS, n))
    ids[0] = NUM_ROWS
    report = torch.zeros(1, dtype=torch.int32)
    tier_read, status = tiers.read(ids.reshape(1, n), NUM_ROWS, None, report, capturing=False)
    assert (status is None) == (n <= interpreted.tiers.SCAN_MAX_IDS)
    out = torch.empty(n, 8)
    interpreted.rows.decode_rows_triton(None, FORMATS["u8"], 1.0, out, status=status, tiers=tier_read)
    assert out.isnan().all() and report.item() == 1
    assert tiers.hits() == (0, n - 1)

    strided = torch.from_numpy(np.random.default_rng(n).integers(0, NUM_ROWS, 2 * n))[::2]
    tier_read, status = tiers.read(strided, NUM_ROWS, None, report, capturing=False)
    interpreted.rows.decode_rows_triton(None, FORMATS["u8"], 1.0, out, status=status, tiers=tier_read)
    assert torch.equal(out, table[strided].to(torch.float32))

    host_gather_status = torch.zeros(1, dtype=torch.int32)
    assert tiers.read(ids, NUM_ROWS, host_gather_status, None, capturing=True)[1] is host_gather_status
    assert tiers.captured


# --- compilation of the variants the operator launches, without a GPU ------------

COMPILE_SCRIPT = r"""
from ple.kernels.decode_gguf_iq_triton import decode_iq_blocks_kernel
from ple.kernels.decode_gguf_k_triton import decode_k_blocks_kernel
from ple.kernels.gguf_bits_triton import LAUNCH_OPTIONS
from ple.kernels.decode_triton import MAX_BLOCK, decode_rows_kernel
from ple.kernels.tier_rows_triton import CHECK_BLOCK, SCAN_MAX_IDS, check_ids_kernel
assert type(decode_rows_kernel).__name__ == "JITFunction"
TIERS = {"ids_ptr": "*i64", "device_ptr": "*u8", "host_ptr": "*u8", "first_row": "i32",
         "device_rows": "i32", "tier_rows": "i32", "num_rows": "i32", "hits_ptr": "*i64",
         "report_ptr": "*i32"}
# With a status word (a host gather's, or check_ids_kernel's when every row is
# resident); every row resident and the ids checked by each program (the
# smallest and the largest scan).
VARIANTS = {"status": (True, 0), "scan16": (False, 16), "scan_max": (False, SCAN_MAX_IDS)}
DECODERS = {"fp8_e4m3fn": (decode_rows_kernel, {"scale": "fp32"}, {}, {}),
            "q4_k": (decode_k_blocks_kernel, {}, {"BB": 144}, LAUNCH_OPTIONS),
            "iq2_xxs": (decode_iq_blocks_kernel, {"grid_ptr": "*i8"}, {"BB": 66}, LAUNCH_OPTIONS)}

results = {}
for cc in json.loads(sys.argv[1]):
    for variant, (has_status, scan) in VARIANTS.items():
        for name, (kernel, args, meta, options) in DECODERS.items():
            constexprs = {"FMT": name, "BLOCK": MAX_BLOCK, "TIERS": True, "HAS_STATUS": has_status,
                          "SCAN_IDS": scan, **meta}
            signature = {"rows_ptr": "*u8", "status_ptr": "*i32", "out_ptr": "*bf16", "cols": "i32",
                         "row_bytes": "i32", **TIERS, **args, **{c: "constexpr" for c in constexprs}}
            src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
            results[f"{cc}-{variant}-{name}"] = compile_summary(src, cc, options)
    src = triton.compiler.ASTSource(fn=check_ids_kernel, signature={
        "ids_ptr": "*i64", "n": "i32", "num_rows": "i32", "status_ptr": "*i32", "report_ptr": "*i32",
        "BLOCK": "constexpr"}, constexprs={"BLOCK": CHECK_BLOCK})
    results[f"{cc}-check_ids"] = compile_summary(src, cc)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("triton")
    return compile_in_subprocess(COMPILE_SCRIPT, [COMPILE_CCS], tmp_path_factory.mktemp("triton-cache"))


@pytest.mark.parametrize("kernel", [f"{variant}-{name}" for variant in ("status", "scan16", "scan_max")
                                    for name in ("fp8_e4m3fn", "q4_k", "iq2_xxs")] + ["check_ids"])
@pytest.mark.parametrize("cc", COMPILE_CCS, ids=lambda cc: f"sm_{cc}")
def test_compiles_for_target(compiled, cc, kernel):
    result = compiled[f"{cc}-{kernel}"]
    assert_runs_on_old_gpus(result, cc)
    assert "atom" in result["ptx"]  # hits, or the status word
