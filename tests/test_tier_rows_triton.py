"""The tier assembly kernel (kernels/tier_rows_triton.py) under Triton's
interpreter, on CPU tensors: each row from its tier, hits counted, bad ids and
failed host gathers flagged.

The kernel module is loaded privately with TRITON_INTERPRET set for the load
only (helpers.load_interpreted): the CUDA operator's own copy stays compiled.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import ple.kernels
from helpers import load_interpreted

KERNEL_FILE = Path(ple.kernels.__file__).parent / "tier_rows_triton.py"


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    module = load_interpreted(KERNEL_FILE)
    assert type(module.assemble_rows_kernel).__name__ == "InterpretedFunction"
    return module


@pytest.mark.parametrize("first_row, device_rows, host_rows, with_disk", [
    (0, 0, 0, True), (0, 30, 0, True), (0, 0, 50, True), (0, 30, 50, True), (0, 40, 60, False),
    (0, 100, 0, False), (25, 30, 20, True), (60, 0, 40, True), (20, 80, 0, True)])
@pytest.mark.parametrize("row_bytes", [1, 17, 160, 1500])
def test_assembly_picks_each_row_from_its_tier(interpreted, first_row, device_rows, host_rows,
                                               with_disk, row_bytes):
    num_rows = 100
    end = first_row + device_rows + host_rows
    rng = np.random.default_rng(row_bytes + first_row)
    table = torch.from_numpy(rng.integers(0, 256, (num_rows, row_bytes), dtype=np.uint8))
    ids = torch.from_numpy(rng.integers(0, num_rows, 37) if with_disk
                           else rng.integers(first_row, end, 37))
    ids[:2] = torch.tensor([first_row, end - 1]) if end > first_row else ids[:2]
    on_device = (ids >= first_row) & (ids < first_row + device_rows)
    on_host = (ids >= first_row + device_rows) & (ids < end)
    on_disk = ~(on_device | on_host)
    staged = torch.zeros((37, row_bytes), dtype=torch.uint8)
    staged[on_disk] = table[ids[on_disk]]
    out = torch.empty((37, row_bytes), dtype=torch.uint8)
    hits = torch.zeros(2, dtype=torch.int64)
    status_out = torch.zeros(1, dtype=torch.int32)
    interpreted.assemble_rows_triton(
        ids, out, table[first_row:first_row + device_rows] if device_rows else None,
        table[first_row + device_rows:end] if host_rows else None,
        staged if with_disk else None, first_row, num_rows, hits,
        torch.zeros(1, dtype=torch.int32) if with_disk else None, status_out)
    assert torch.equal(out, table[ids])
    assert hits.tolist() == [int(on_device.sum()), int(on_host.sum())]
    assert status_out.item() == 0


@pytest.mark.parametrize("bad_id, status_in", [(100, 0), (-1, 0), (5, 1)])
def test_assembly_flags_bad_ids_and_failed_host_gathers(interpreted, bad_id, status_in):
    table = torch.arange(100, dtype=torch.uint8).reshape(100, 1)
    ids = torch.tensor([3, bad_id, 7])
    out = torch.empty((3, 1), dtype=torch.uint8)
    status_out = torch.zeros(1, dtype=torch.int32)
    has_disk = status_in != 0
    device_rows = 10 if has_disk else 100
    interpreted.assemble_rows_triton(
        ids, out, table[:device_rows], None, torch.zeros((3, 1), dtype=torch.uint8) if has_disk else None,
        0, 100, torch.zeros(2, dtype=torch.int64),
        torch.tensor([status_in], dtype=torch.int32) if has_disk else None, status_out)
    assert status_out.item() == 1


def test_a_bad_id_is_reported_and_a_good_call_does_not_clear_it(interpreted):
    table = torch.arange(100, dtype=torch.uint8).reshape(100, 1)
    report = torch.zeros(1, dtype=torch.int32)

    def assemble(ids):
        status_out = torch.zeros(1, dtype=torch.int32)
        interpreted.assemble_rows_triton(ids, torch.empty((len(ids), 1), dtype=torch.uint8), table,
                                         None, None, 0, 100, torch.zeros(2, dtype=torch.int64),
                                         None, status_out, report)
        return status_out.item()

    assert assemble(torch.tensor([3, 7])) == 0 and report.item() == 0
    assert assemble(torch.tensor([3, 100])) == 1 and report.item() == 1
    assert assemble(torch.tensor([3, 7])) == 0 and report.item() == 1
