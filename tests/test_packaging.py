"""`python -m build --no-isolation` from a venv that has torch: the sdist
holds what a wheel build needs (the C++ sources, the tools, the license) and
the console scripts (marked slow: about 20 s); with PLE_TEST_WHEEL=1 the whole build (sdist, then a
wheel compiled from it) runs too.  That compiles the native part, a minute or
more on 2 cores (4 to 5 minutes on a busy machine), so it is not in the
default run.  Both build a copy of the checkout, not the checkout itself
(setuptools writes ple.egg-info and build/ where it builds)."""

from __future__ import annotations

import os
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
