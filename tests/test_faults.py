"""A table file that shrinks, is replaced or is closed under a running gather:
an exception, never a dead process."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple
from helpers import close_while_threads_gather, write_random_rows

ROWS, ROW_BYTES = 50_000, 160



@pytest.mark.parametrize("policy", ple.POLICIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_truncated_file_raises_and_the_rest_still_works(tmp_path, policy, threads):
    path = tmp_path / "t.safetensors"
    reference = write_random_rows(path, ROWS, ROW_BYTES)
    with ple.Table.from_safetensors(path, config=ple.GatherConfig(policy, 4096, threads)) as table:
        table.drop_page_cache()
        os.truncate(path, os.path.getsize(path) // 2)
        lost = torch.tensor([3, ROWS - 1, 5])
        with pytest.raises(OSError, match=rf"{path}, byte \d+: row {ROWS - 1} could not be read"):
            table.gather_bytes(lost)
        many = torch.from_numpy(np.random.default_rng(1).integers(0, ROWS, 4000))
        with pytest.raises(OSError, match=rf"{path}, byte \d+: row \d+ could not be read"):
            torch.ops.ple.disk_gather(many, table.handle)
        kept = torch.from_numpy(np.random.default_rng(2).integers(0, ROWS // 3, 4000))
        assert np.array_equal(table.gather_bytes(kept).numpy(), reference[kept.numpy()])


def test_a_file_replaced_or_deleted_while_open_serves_its_old_bytes(tmp_path):
    path = tmp_path / "t.safetensors"
    reference = write_random_rows(path, ROWS, ROW_BYTES)
    ids = torch.arange(0, ROWS, 97)
    with ple.Table.from_safetensors(path) as table:
        other = tmp_path / "other.safetensors"
        save_file({"t": torch.zeros(ROWS, ROW_BYTES, dtype=torch.uint8)}, str(other))
        os.replace(other, path)
        assert np.array_equal(table.gather_bytes(ids).numpy(), reference[ids.numpy()])
        os.unlink(path)
        assert np.array_equal(table.gather_bytes(ids).numpy(), reference[ids.numpy()])


def test_closing_while_other_threads_gather(tmp_path):
    path = tmp_path / "t.safetensors"
    reference = write_random_rows(path, ROWS, ROW_BYTES)
    close_while_threads_gather(ple.Table.from_safetensors(path), reference)


@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_sigbus_that_is_not_from_a_gather_still_kills(tmp_path, faulthandler):
    path = tmp_path / "t.safetensors"
    write_random_rows(path, ROWS, ROW_BYTES)
    script = (
        "import os, signal, sys, torch, ple\n"
        f"t = ple.Table.from_safetensors({str(path)!r})\n"
        "t.gather_bytes(torch.tensor([1]))  # installs the handler\n"
        "os.kill(os.getpid(), signal.SIGBUS)\n"
        "print('survived')\n")
    flags = ["-X", "faulthandler"] if faulthandler else []
    result = subprocess.run([sys.executable, *flags, "-c", script], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr[-2000:])
    assert "survived" not in result.stdout
    if faulthandler:  # the handler that was there before still had its say
        assert "Fatal Python error: Bus error" in result.stderr
