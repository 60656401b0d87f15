"""The tools' command lines: every console script of pyproject.toml is
installed and points at a ``main`` of ``ple.tools``; each tool's ``--help``
gives a description that is a whole sentence and a help text for every
option, and the tool's module answers it without importing torch (it parses
its arguments before any heavy import).

``ple-<tool> --help`` itself still imports torch: Python runs
``ple/__init__.py`` before any ``ple.tools`` module, and ``import ple``
registers ``torch.ops.ple``.  So the torch-free check runs each tool's file
as ``python tools/<tool>.py --help`` does (runpy.run_path), and the console
scripts are checked for their wiring and their help.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
HEAVY = ("torch", "numpy", "ple", "safetensors", "gguf", "transformers", "tqdm")

# Runs one tool's file with --help, as `python tools/<tool>.py --help`, and
# prints what its parser holds and which heavy modules were imported.
HELP_PROBE = r"""
import argparse, json, runpy, sys
parsers = []
parse_known_args = argparse.ArgumentParser.parse_known_args
def spy(self, args=None, namespace=None):
    parsers.append(self)
    return parse_known_args(self, args, namespace)
argparse.ArgumentParser.parse_known_args = spy
name, path, heavy = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
sys.argv = [name, "--help"]
try:
    runpy.run_path(path, run_name="__main__")
    code = "returned"
except SystemExit as exit:
    code = exit.code
parser = parsers[0]
print("\nPROBE " + json.dumps({
    "code": code, "description": parser.description,
    "options": [[a.option_strings or [a.dest], a.help] for a in parser._actions
                if a.help != argparse.SUPPRESS],
    "imported": [m for m in heavy if m in sys.modules]}))
"""


def tool_file(target: str) -> Path:
    module = target.split(":")[0]
    assert module.startswith("ple.tools."), target
    return REPO / "tools" / f"{module.removeprefix('ple.tools.')}.py"


def probe(name: str) -> tuple[dict, str, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", HELP_PROBE, name, str(tool_file(SCRIPTS[name])),
                           ",".join(HEAVY)], cwd=REPO, capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    usage, _, result = proc.stdout.rpartition("\nPROBE ")
    return json.loads(result), usage, seconds


def test_every_script_is_a_tool_and_installed():
    assert set(SCRIPTS) == {"ple-demo", "ple-make-table", "ple-bench-gather", "ple-bench-gpu",
                            "ple-bench-layers", "ple-tiny-model", "ple-bench-transformers"}
    for name, target in SCRIPTS.items():
        assert target.endswith(":main") and tool_file(target).is_file(), (name, target)
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")
                 if ep.dist is not None and ep.dist.name == "ple"}
    assert installed == SCRIPTS, "the installed ple is stale: reinstall it (make setup)"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_of_each_tool(name):
    info, usage, seconds = probe(name)
    assert info["code"] == 0, info
    assert f"usage: {tool_file(SCRIPTS[name]).name}" in usage  # runpy sets argv[0] to the file
    description = " ".join(info["description"].split())
    assert description[0].isupper() and description.endswith("."), description
    for option, text in info["options"]:
        assert text and text.strip(), f"{name} {option}: no help text"
    assert info["imported"] == [], f"{name} --help imported {info['imported']}"
    assert seconds < 5, f"{name} --help took {seconds:.1f} s"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_entry_point_answers_help(name, capsys, monkeypatch):
    """The entry point's function (here, where torch is imported already)."""
    module, _, function = SCRIPTS[name].partition(":")
    main = getattr(importlib.import_module(module), function)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {name} ")


def test_an_installed_console_script_runs():
    """One generated script, as a user runs it (it imports torch through ple)."""
    command = shutil.which("ple-make-table", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert command is not None, "ple-make-table is not installed next to this Python"
    proc = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: ple-make-table "), proc.stderr
