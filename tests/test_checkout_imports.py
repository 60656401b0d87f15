"""A checkout hides no package: Python started in its root (where ``make
demo`` leaves a user and ``python -m pytest`` runs) finds the packages named
like its folders kernels/, ops/, layers/ and tools/ wherever they are
installed, Hugging Face's ``kernels`` among them, which transformers'
models import (they import in the root with it installed, without it, and
beside a ``kernels`` of the user's, on whatever transformers runs them);
and Python started in the folder that holds a checkout named ``ple`` says
so (its top folder is not the installed ple).  ple's own names stay where
they were: ``ple.kernels``, ``ple.ops``, ``ple.layers`` (with its layers by
name) and ``ple_tools``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
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


# In the checkout's root: transformers' models (Qwen4Exp where this
# transformers has it), then what ``kernels`` is to Python and to transformers.
MODELS_IN_THE_ROOT = """
import importlib.util, json
import transformers.models.gemma3n.modeling_gemma3n
if importlib.util.find_spec("transformers.models.qwen4_exp") is not None:
    import transformers.models.qwen4_exp.modeling_qwen4_exp
from transformers.utils.import_utils import is_kernels_available
spec = importlib.util.find_spec("kernels")
print(json.dumps({"origin": spec and spec.origin,
                  "locations": list(spec and spec.submodule_search_locations or []),
                  "transformers_takes_it": is_kernels_available()}))
"""


def site_packages_without_kernels(tmp_path: Path) -> Path:
    """This Python's site-packages and PYTHONPATH's folders as one folder of
    links to their entries (the first of a name), less Hugging Face's kernels
    (its package and its dist-info): a Python that adds it (-S,
    site.addsitedir) and no PYTHONPATH has no kernels installed, as the GPU
    machine's image has none."""
    folders = [*filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
               sysconfig.get_paths()["purelib"]]
    links = tmp_path / "site-packages"
    links.mkdir()
    for folder in map(Path, folders):
        for entry in folder.iterdir() if folder.is_dir() else ():
            if entry.name == "kernels" or (entry.name.startswith("kernels-")
                                           and entry.name.endswith(".dist-info")):
                continue
            if not (links / entry.name).exists():
                (links / entry.name).symlink_to(entry)
    return links


def models_in_the_root(tmp_path: Path, kernels: str) -> dict:
    """MODELS_IN_THE_ROOT's answer, run with Hugging Face's kernels as
    ``kernels`` says: "installed" (this Python's own), "absent", or "a
    package of the user's" (a kernels package of theirs on PYTHONPATH, none
    installed)."""
    code, env = MODELS_IN_THE_ROOT, {}
    if kernels != "installed":
        code = (f"import site\nsite.addsitedir({str(site_packages_without_kernels(tmp_path))!r})\n"
                + code)
        env["PYTHONPATH"] = ""
    if kernels == "a package of the user's":
        (tmp_path / "theirs" / "kernels").mkdir(parents=True)
        (tmp_path / "theirs" / "kernels" / "__init__.py").write_text("")
        env["PYTHONPATH"] = str(tmp_path / "theirs")
    run = python(code, REPO, *([] if kernels == "installed" else ["-S"]), **env)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_transformers_models_import_in_the_checkout_beside_an_installed_kernels(tmp_path):
    """Where Hugging Face's kernels is installed, the models import it, not
    the checkout's kernels/ folder."""
    pytest.importorskip("transformers")
    installed = importlib.util.find_spec("kernels")
    if installed is None or installed.origin is None:
        pytest.skip("Hugging Face's kernels is not installed here")
    assert models_in_the_root(tmp_path, "installed")["origin"] == installed.origin


def test_transformers_models_import_in_the_checkout_beside_a_kernels_of_the_users(tmp_path):
    """A package named kernels that a user has (on PYTHONPATH here) is the
    one Python finds, not the checkout's folder."""
    pytest.importorskip("transformers")
    found = models_in_the_root(tmp_path, "a package of the user's")
    assert found["origin"] == str(tmp_path / "theirs" / "kernels" / "__init__.py")
    # It has no version: no release of Hugging Face's, which transformers takes.
    assert found["transformers_takes_it"] is False


def test_transformers_models_import_in_the_checkout_without_kernels(tmp_path):
    """Where no kernels is installed (transformers 5.24 on the GPU machine),
    Python may find the checkout's kernels/ folder by that name, a
    namespace portion with nothing in it that transformers could take: the
    models import, and transformers does not take it for Hugging Face's."""
    pytest.importorskip("transformers")
    found = models_in_the_root(tmp_path, "absent")
    assert found["origin"] in (None, "namespace")
    assert found["locations"] in ([], [str(REPO / "kernels")])
    assert found["transformers_takes_it"] is False


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
