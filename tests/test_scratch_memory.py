"""A gather's scratch (its row list, sort buffers, page lists, the direct
reader's read plan) does not outlive a call that needed more than the
kept bound: after a gather of millions of ids the resident set comes back
to what it was.  Measured in a child (/proc/self/statm), on a table of 16
rows gathered over and over, so that the rows cost nothing to read."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import torch
from safetensors.torch import save_file

# What a gather may keep between calls, with room for the allocator's own
# bookkeeping: kernels/row_gather.cpp's kKeptScratchBytes is 16 MiB.
KEPT_MIB = 24


def test_scratch_of_a_huge_gather_is_released_after_it(tmp_path):
    path = tmp_path / "t.safetensors"
    rows = np.arange(64, dtype=np.uint8).reshape(16, 4)
    save_file({"t": torch.from_numpy(rows)}, str(path))
    script = textwrap.dedent("""
        import os, sys
        import numpy as np, torch, ple
        PAGE = os.sysconf("SC_PAGESIZE")

        def rss_mib():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * PAGE / 2**20

        t = ple.Table.from_safetensors(sys.argv[1])
        expected = np.arange(64, dtype=np.uint8).reshape(16, 4)
        # The ids and the output are made once, so that only ple's memory
        # comes and goes (the allocator keeps what torch frees of tensors
        # this size).
        ids = torch.arange(16, dtype=torch.int32).repeat(20_000_000 // 16)
        out = torch.zeros(20_000_000, 4, dtype=torch.uint8)
        # Each way a gather reads: in request order (warm rows), sorted by
        # address with advice ("all"), and with direct reads.
        for name, config, n in [("request order", ple.GatherConfig(), 20_000_000),
                                ("sorted", ple.GatherConfig("all"), 4_000_000),
                                ("direct", ple.GatherConfig(io="direct"), 4_000_000)]:
            t.config = config
            small = ids[:1024]
            assert np.array_equal(t.gather_bytes(small).numpy(), expected[small.numpy()])
            before = rss_mib()
            t.gather_bytes(ids[:n], out=out[:n])
            assert np.array_equal(out[n - 16:n].numpy(), expected), name
            print(f"{name}: {rss_mib() - before:+.1f} MiB", flush=True)
        t.close()
    """)
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, (result.stdout, result.stderr[-3000:])
    growth = {line.split(":")[0]: float(line.split(":")[1].split()[0])
              for line in result.stdout.splitlines()}
    assert len(growth) == 3, result.stdout
    assert all(mib < KEPT_MIB for mib in growth.values()), result.stdout
