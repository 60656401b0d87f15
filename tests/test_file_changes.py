"""What a gather serves when a table's file changes under it, beyond
tests/test_faults.py: a file truncated and extended again, and a truncated
file while Python's faulthandler is enabled.  They pin down what README
"Faults" and "Reliability" say, so that the text stays true."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch
from safetensors.torch import save_file

import ple
from helpers import REPO

ROWS, ROW_BYTES = 20_000, 160


def write_table(path):
    reference = np.random.default_rng(0).integers(1, 256, (ROWS, ROW_BYTES), dtype=np.uint8)
    save_file({"t": torch.from_numpy(reference)}, str(path))
    return reference


def test_truncated_then_extended_serves_zeros_for_the_lost_range(tmp_path):
    """The mapping still covers the old size, and the pages past the cut were
    dropped with it: once the file is as long again, those pages are holes,
    read as zeros, and no gather raises.  (No row of the reference is zero:
    values are 1 to 255.)  Bytes written there later are served as written."""
    path = tmp_path / "t.safetensors"
    reference = write_table(path)
    size = os.path.getsize(path)
    with ple.Table.from_safetensors(path) as table:
        ids = torch.arange(ROWS)
        assert np.array_equal(table.gather_bytes(ids).numpy(), reference)  # warm: all pages cached
        os.truncate(path, size // 2)
        os.truncate(path, size)
        rows = table.gather_bytes(ids).numpy()
        lost = next(r for r in range(ROWS) if not np.array_equal(rows[r], reference[r]))
        assert 0 < lost < ROWS
        assert np.array_equal(rows[:lost], reference[:lost])
        assert not rows[lost + 1:].any(), "rows past the cut are not all zeros"
        assert not rows[lost][rows[lost] != reference[lost]].any()  # the row across the cut: zeros
        data = torch.ops.ple.disk_gather(ids[-3:], table.handle)
        assert not data.any()  # the operator as well: zeros, times the scale
        offset = size - ROW_BYTES  # the last row, written again in place
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(bytes([7]) * ROW_BYTES)
        assert table.gather_bytes(torch.tensor([ROWS - 1])).numpy().tolist() == [[7] * ROW_BYTES]


FAULTHANDLER_SCRIPT = r"""
import faulthandler, os, sys
import torch, ple
path, when = sys.argv[1], sys.argv[2]
if when == "before":
    faulthandler.enable()
with ple.Table.from_safetensors(path, config=ple.GatherConfig(threads=2)) as table:
    table.gather_bytes(torch.tensor([0]))
    if when == "after":
        faulthandler.enable()  # replaces ple's handler; the next gather puts it back in front
    table.drop_page_cache()
    os.truncate(path, os.path.getsize(path) // 2)
    for ids in (torch.tensor([%d]), torch.arange(0, %d, 3)):
        try:
            table.gather_bytes(ids)
            print("no error")
        except OSError as error:
            print("OSError", error)
print("alive")
""" % (ROWS - 1, ROWS)


def test_faulthandler_stays_quiet_for_the_faults_the_guard_handles(tmp_path):
    """With faulthandler enabled before or after the first gather, a
    truncated file raises OSError and faulthandler prints nothing ("Fatal
    Python error: Bus error" would come from its handler running first)."""
    for when in ("before", "after"):
        path = tmp_path / f"{when}.safetensors"
        write_table(path)
        proc = subprocess.run([sys.executable, "-c", FAULTHANDLER_SCRIPT, str(path), when],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (when, proc.stderr[-3000:])
        lines = proc.stdout.splitlines()
        assert [line.split()[0] for line in lines] == ["OSError", "OSError", "alive"], (when, lines)
        assert "could not be read" in lines[0]
        assert "Fatal Python error" not in proc.stderr, (when, proc.stderr[-3000:])
