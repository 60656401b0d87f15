"""The import-time build: with no matching prebuilt module, ple compiles the
same sources with ninja and works the same."""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import sys, torch, ple, ple.kernels.native as n
from safetensors.torch import save_file
assert n.native.__name__.startswith("ple_native_"), n.native.__name__
assert n.native.torch_version == torch.__version__
rows = torch.arange(40 * 3, dtype=torch.uint8).reshape(40, 3)
save_file({"t": rows}, sys.argv[1])
with ple.Table.from_safetensors(sys.argv[1]) as table:
    ids = torch.tensor([39, 0, 7, 7])
    assert torch.equal(torch.ops.ple.disk_gather_bytes(ids, table.handle), rows[ids])
print("jit ok")
"""


@pytest.mark.slow
def test_import_compiles_the_sources_when_no_prebuilt_module_matches(tmp_path):
    env = dict(os.environ, PLE_FORCE_JIT="1", PLE_BUILD_DIR=str(tmp_path / "build"))
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "t.safetensors")],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "jit ok" in result.stdout
    assert "compiling the native gather" in result.stderr
