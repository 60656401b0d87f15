"""Every ``python`` and ``bash`` block of README.md and of docs/*.md runs as
written, as the README says to run them: each page's blocks in order, each
in a process of its own, in one empty directory outside the checkout (a
block may read the files an earlier one wrote), with the environment of the
running interpreter active (its scripts first on PATH, VIRTUAL_ENV set, as
``. .venv/bin/activate`` leaves them).  A block whose first line is ``#
needs a GPU...`` runs only where CUDA is; blocks of another language
(``text``: signatures; none: install and make lines) are shown, not run.
The counters table of docs/counters.md is ple.COUNTERS."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
BLOCK = re.compile(r"^```(?P<language>python|bash)\n(?P<code>.*?)^```$", re.S | re.M)
NEEDS_A_GPU = "# needs a GPU"
RUNNERS = {"python": [sys.executable, "-c"], "bash": ["bash", "-euo", "pipefail", "-c"]}
# The optional extras a page's python blocks may import: such a page runs
# where its extra is installed (make's venv has them; the torch-range venvs
# install the test extra alone).
EXTRAS = ("transformers", "vllm")
IMPORTS = re.compile(r"^\s*(?:from|import) (\w+)", re.M)


def runnable_blocks(page: Path) -> list[tuple[str, str]]:
    """The page's (language, code) blocks that this machine runs, in order."""
    return [(m["language"], m["code"]) for m in BLOCK.finditer(page.read_text())
            if torch.cuda.is_available() or not m["code"].startswith(NEEDS_A_GPU)]


def run_blocks(page: Path, directory: Path) -> list[str]:
    """Runs the page's blocks in ``directory``, outside the checkout;
    returns what each printed.  The console scripts are those of the running
    interpreter's environment, activated."""
    assert not directory.resolve().is_relative_to(REPO), directory
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if sys.prefix != sys.base_prefix:  # a virtual environment's interpreter
        env["VIRTUAL_ENV"] = sys.prefix
    printed = []
    for number, (language, code) in enumerate(runnable_blocks(page), 1):
        done = subprocess.run([*RUNNERS[language], code], cwd=directory, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (
            f"{page.name}, {language} block {number} failed:\n{code}\n{done.stdout}{done.stderr}")
        printed.append(done.stdout)
    return printed


@pytest.mark.slow  # about 35 s on 2 cores: a tiny Qwen4Exp checkpoint written and loaded twice
def test_every_readme_block_runs_as_written(tmp_path):
    pytest.importorskip("transformers")  # the README's model examples; make's venv has it
    printed = run_blocks(README, tmp_path)
    first, second = printed[0].splitlines()
    assert first.startswith("ple.Table('emb', 100000 rows x 64 fp8_e4m3fn, 2 shard(s), scale=0.5")
    assert second == "4 3"


DOCS = sorted(page for page in (REPO / "docs").glob("*.md") if BLOCK.search(page.read_text()))


@pytest.mark.parametrize("page", DOCS, ids=[page.name for page in DOCS])
def test_every_block_of_a_doc_runs_as_written(page, tmp_path):
    imported = {module for _, code in runnable_blocks(page) for module in IMPORTS.findall(code)}
    for module in sorted(imported & set(EXTRAS)):
        pytest.importorskip(module)
    run_blocks(page, tmp_path)


def test_the_counters_table_is_ple_counters():
    import ple

    section = (REPO / "docs" / "counters.md").read_text()
    listed = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", section, re.M))
    assert listed == dict(ple.COUNTERS)
