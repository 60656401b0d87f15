"""`python -m build --no-isolation` from a venv that has torch: the sdist
holds what a wheel build needs (the C++ sources, the tools, the license) and
the console scripts (marked slow: about 20 s); with PLE_TEST_WHEEL=1 the whole build (sdist, then a
wheel compiled from it) runs too.  That compiles the native part, a minute or
more on 2 cores (4 to 5 minutes on a busy machine), so it is not in the
default run.  Both build a copy of the checkout, not the checkout itself
(setuptools writes ple.egg-info and build/ where it builds).

An old setuptools stops the build with a line that names the fix; with
PLE_TEST_INSTALL_TORCH=<a torch requirement> (make test-fresh-install gives the
oldest supported), the README's install lines run in a fresh venv of this
Python with that torch, and ple gathers there."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("build")
tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def checkout_copy(where: Path) -> Path:
    """The checkout's files that git tracks or would track (not ignored)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to know which files are the project's")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    copy = where / "ple"
    for name in filter(None, (n.decode() for n in listed)):
        source = REPO / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def build(copy: Path, out: Path, *flags: str, timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", *flags,
                           "--outdir", str(out), str(copy)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PIP_NO_INDEX": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def expected_files(copy: Path) -> set[str]:
    return ({f"kernels/{p.name}" for p in (copy / "kernels").glob("*.[ch]*") if p.suffix in (".cpp", ".h")}
            | {f"tools/{p.name}" for p in (copy / "tools").glob("*.py")}
            | {f"tools/{p.name}" for p in (copy / "tools").glob("*.cpp")}  # bench_warm's floor
            | {"kernels/build_flags.py", "LICENSE", "README.md", "pyproject.toml", "setup.py"})


@pytest.mark.slow
def test_sdist_holds_the_sources_tools_and_scripts(tmp_path):
    """About 20 s: build runs setup.py, which imports torch, twice."""
    copy = checkout_copy(tmp_path)
    build(copy, tmp_path / "dist", "--sdist", timeout=300)
    (sdist,) = (tmp_path / "dist").glob("ple-*.tar.gz")
    with tarfile.open(sdist) as archive:
        root = archive.getnames()[0].split("/")[0]
        names = {n.removeprefix(f"{root}/") for n in archive.getnames()}
        entry_points = archive.extractfile(f"{root}/ple.egg-info/entry_points.txt").read().decode()
    missing = expected_files(copy) - names
    assert not missing, missing
    for name, target in SCRIPTS.items():
        assert f"{name} = {target}" in entry_points


@pytest.mark.skipif(os.environ.get("PLE_TEST_WHEEL") != "1",
                    reason="compiles the native part (minutes); PLE_TEST_WHEEL=1 runs it")
def test_build_sdist_and_wheel(tmp_path):
    import torch

    sys.path.insert(0, str(REPO / "kernels"))
    try:
        from build_flags import module_name
    finally:
        sys.path.pop(0)
    copy = checkout_copy(tmp_path)
    proc = build(copy, tmp_path / "dist", timeout=1800)
    assert "ple: building the native gather" in proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("ple-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert {f"ple_tools/{p.name}" for p in (copy / "tools").glob("*.[pc]*")
            if p.suffix in (".py", ".cpp")} <= names
    assert any(n.startswith(f"ple/kernels/{module_name(torch.__version__)}.") and n.endswith(".so")
               for n in names), sorted(n for n in names if n.startswith("ple/kernels/"))
    for name, target in SCRIPTS.items():
        assert f"{name} = {target}" in entry_points


SETUPTOOLS_MESSAGE = ("ple builds with setuptools 77 or newer, and this environment has {version}: "
                      "run `pip install 'setuptools>=77'`, then install ple again")


def test_an_old_setuptools_stops_the_build_naming_the_fix(tmp_path):
    """setup.py checks before setup() reads pyproject.toml, whose license
    field setuptools before 77 refuses with a schema error."""
    (tmp_path / "setuptools").mkdir()
    (tmp_path / "setuptools" / "__init__.py").write_text(
        "__version__ = '65.5.0'\n\n"
        "def setup(**options):\n    raise AssertionError('setup() ran')\n")
    run = subprocess.run([sys.executable, "setup.py", "--version"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 1
    assert run.stderr == SETUPTOOLS_MESSAGE.format(version="65.5.0") + "\n"


def readme_install_lines() -> list[list[str]]:
    """The README's lines that install torch, then ple (the others add its
    extras), as arguments."""
    section = (REPO / "README.md").read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```\n")[1]
    lines = [shlex.split(line.split(" #")[0]) for line in block.splitlines()]
    return [words for words in lines if not any("[" in word for word in words)]


GATHER = """
import torch, ple
from safetensors.torch import save_file
rows = torch.randn(1000, 16)
save_file({"emb.weight": rows}, "table.safetensors")
ids = torch.tensor([[3, 999], [0, 3]])
with ple.Table.from_safetensors("table.safetensors", "emb.weight") as table:
    assert torch.equal(ple.gather(table, ids), rows[ids])
print(torch.__version__, ple.__file__)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PLE_TEST_INSTALL_TORCH"),
                    reason="installs torch into a fresh venv and compiles ple (minutes); make "
                    "test-fresh-install runs it with PLE_TEST_INSTALL_TORCH=<the oldest torch>")
def test_the_readmes_install_lines_in_a_fresh_venv(tmp_path):
    """As a user on a fresh machine: a venv of this Python (3.11's brings
    setuptools 65), the torch alone (as a user who knows only torch is
    needed), ple's build refusing that setuptools with its message, then
    the README's lines as written, the torch given."""
    torch_requirement = os.environ["PLE_TEST_INSTALL_TORCH"]
    lines = readme_install_lines()
    assert [words[:3] for words in lines] == [["pip", "install", "torch"],
                                              ["pip", "install", "--no-build-isolation"]], lines
    copy = checkout_copy(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")

    def pip(*arguments: str, timeout: int) -> subprocess.CompletedProcess:
        return subprocess.run([python, "-m", "pip", *arguments], cwd=copy, capture_output=True,
                              text=True, timeout=timeout)

    installed = pip("install", torch_requirement, timeout=1800)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    version = subprocess.run([python, "-c", "import setuptools; print(setuptools.__version__)"],
                             capture_output=True, text=True, timeout=60)
    if version.returncode == 0 and int(version.stdout.split(".")[0]) < 77:
        refused = pip("install", "--no-build-isolation", ".", timeout=600)
        assert refused.returncode != 0
        assert SETUPTOOLS_MESSAGE.format(version=version.stdout.strip()) in refused.stderr, (
            refused.stdout[-3000:] + refused.stderr[-3000:])
    for words in lines:
        arguments = [torch_requirement if word == "torch" else word for word in words[2:]]
        done = pip("install", *arguments, timeout=1800)
        assert done.returncode == 0, (words, done.stdout[-3000:] + done.stderr[-3000:])
    # From a folder of the user's own: from the checkout's parent, import ple
    # refuses the checkout (tests/test_checkout_imports.py).
    work = tmp_path / "work"
    work.mkdir()
    gathered = subprocess.run([python, "-c", GATHER], cwd=work, capture_output=True,
                              text=True, timeout=600)
    assert gathered.returncode == 0, gathered.stderr[-3000:]
    torch_version, ple_file = gathered.stdout.split()
    assert f"torch=={torch_version.split('+')[0]}" == torch_requirement.split("+")[0]
    assert Path(ple_file).is_relative_to(venv)
