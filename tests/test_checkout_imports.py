"""A checkout hides no package: Python started in its root (where ``make
demo`` leaves a user and ``python -m pytest`` runs) finds the packages named
like its folders kernels/, ops/, layers/ and tools/ wherever they are
installed, Hugging Face's ``kernels`` among them, which transformers'
models import; and Python started in the folder that holds a checkout named
``ple`` says so (its top folder is not the installed ple).  ple's own
names stay where they were: ``ple.kernels``, ``ple.ops``, ``ple.layers``
(with its layers by name) and ``ple_tools``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "layers", "ops", "tools")


def python(code: str, cwd: Path, *flags: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def test_the_checkouts_folders_hide_no_package_of_their_names(tmp_path):
    """Packages of these names installed anywhere on sys.path are found
    before the checkout's folders, which come first there."""
    for name in FOLDERS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"WHERE = {str(tmp_path)!r}\n")
    run = python("import importlib, json\n"
                 f"print(json.dumps({{n: importlib.import_module(n).WHERE for n in {FOLDERS}}}))",
                 REPO, PYTHONPATH=str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == dict.fromkeys(FOLDERS, str(tmp_path))


def test_transformers_models_import_in_the_checkout():
    """transformers 5.25's models import Hugging Face's kernels package
    (where it is installed); the checkout's kernels/ folder does not stand in
    for it."""
    pytest.importorskip("transformers")
    run = python("import importlib.util\n"
                 "import transformers.models.gemma3n.modeling_gemma3n\n"
                 "import transformers.models.qwen4_exp.modeling_qwen4_exp\n"
                 "spec = importlib.util.find_spec('kernels')\n"
                 "print(spec.origin if spec.origin else list(spec.submodule_search_locations))",
                 REPO)
    assert run.returncode == 0, run.stderr
    assert str(REPO / "kernels") not in run.stdout, run.stdout


def test_ple_keeps_its_subpackages_and_names():
    run = python("import json, torch, ple, ple_tools.make_table\n"
                 "import ple.layers.lookahead\n"
                 "from ple.layers import *\n"
                 "from ple.kernels.native import native\n"
                 "try:\n"
                 "    ple.layers.DiskEmbeding\n"
                 "except AttributeError as error:\n"
                 "    unknown = str(error)\n"
                 "print(json.dumps([sorted(ple.layers.__all__), DiskEmbedding.__module__,\n"
                 "                  NGramHashing.__module__,\n"
                 "                  hasattr(torch.ops.ple, 'disk_gather'), unknown]))",
                 REPO)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [
        ["DiskEmbedding", "NGramEmbedding", "NGramHashing", "PackedGGUFEmbedding"],
        "ple.layers.disk_embedding", "ple.layers.ngram_ids", True,
        "module 'ple.layers' has no attribute 'DiskEmbeding'"]


# ---- a checkout named ple in the working directory ----------------------------------------

def test_beside_a_checkout_named_ple_import_ple_says_what_happened(tmp_path):
    """Python started in the folder that holds the checkout finds its top
    folder as ``ple`` first: importing it says so, whether ple is installed
    or not (-S: no site-packages); started anywhere else, or in the
    checkout, Python imports the installed ple."""
    (tmp_path / "ple").symlink_to(REPO)
    for flags in ((), ("-S",)):
        run = python("import ple", tmp_path, *flags)
        assert run.returncode == 1
        assert run.stderr.strip().splitlines()[-1] == (
            f"ImportError: 'ple' was imported from {tmp_path / 'ple'}, a checkout of the ple "
            "repository, because Python runs in the folder that holds it: run Python from "
            "another folder (or from the checkout itself) to import the installed ple")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = "import torch, ple\nprint(ple.Table.__name__, hasattr(torch.ops.ple, 'disk_gather'))"
    for where in (elsewhere, REPO):
        run = python(code, where)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == ["Table", "True"]
