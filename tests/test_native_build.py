"""The import-time build: with no matching prebuilt module, ple compiles the
same sources with ninja and works the same; and the build's flags and the
supported torch range, stated in three places, agree."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ple.kernels.build_flags import OLDEST_TORCH, compile_args, torch_release, unsupported

REPO = Path(__file__).resolve().parent.parent

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
@pytest.mark.torch_range
def test_import_compiles_the_sources_when_no_prebuilt_module_matches_and_says_so_once(tmp_path):
    env = dict(os.environ, PLE_FORCE_JIT="1", PLE_BUILD_DIR=str(tmp_path / "build"))
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "t.safetensors")],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "jit ok" in result.stdout
    assert "compiling the native gather" in result.stderr
    # A second process finds the module built and says nothing.
    again = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "t.safetensors")],
                           env=env, capture_output=True, text=True, timeout=600)
    assert (again.returncode, again.stdout, again.stderr) == (0, "jit ok\n", ""), (
        again.returncode, again.stdout, again.stderr[-3000:])


def test_no_language_standard_is_forced():
    # torch's extension builder adds the standard its headers need (C++20 from
    # torch 2.14 on); one of ours would come after it and win.
    assert not [flag for flag in compile_args(torch.__version__) if flag.startswith("-std")]


def test_the_running_torch_is_supported():
    assert unsupported(torch.__version__) is None
    assert unsupported("2.8.0") and "torch 2.8.0" in unsupported("2.8.0")


def test_pyproject_and_makefile_state_the_oldest_supported_torch():
    oldest = ".".join(map(str, OLDEST_TORCH))
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(rf'"torch>={re.escape(oldest)}"', pyproject)
    makefile = (REPO / "Makefile").read_text()
    tested = re.search(r"^TORCH_OLDEST \?= torch==(\S+)$", makefile, re.MULTILINE).group(1)
    assert torch_release(tested) == OLDEST_TORCH


@pytest.mark.skipif(os.environ.get("PLE_FORCE_JIT") == "1", reason="PLE_FORCE_JIT=1 compiles at import")
def test_the_installed_module_is_the_one_built_for_this_torch():
    # setup.py names the module after the torch it builds against, so venvs of
    # several torches over one checkout keep a module each (make test-torch-range).
    import ple.kernels.native as native
    from ple.kernels.build_flags import module_name

    assert native.native.__name__ == f"ple.kernels.{module_name(torch.__version__)}", (
        "no module built by setup.py for this torch: install ple here "
        "(pip install --no-build-isolation -e .)")
