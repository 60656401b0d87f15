"""The tools' command lines: every console script of pyproject.toml is
installed and points at a ``main`` of ``ple_tools``; each tool's ``--help``
gives a description that is a whole sentence and a help text for every
option, and answers without importing torch (the tools are a package beside
``ple``, and each parses its arguments before any heavy import).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
HEAVY = ("torch", "numpy", "ple", "safetensors", "gguf", "transformers", "tqdm")

# Calls one console script's function with --help, as the generated script
# does, and prints what its parser holds and which heavy modules were imported.
HELP_PROBE = r"""
import argparse, importlib, json, sys
parsers = []
parse_known_args = argparse.ArgumentParser.parse_known_args
def spy(self, args=None, namespace=None):
    parsers.append(self)
    return parse_known_args(self, args, namespace)
argparse.ArgumentParser.parse_known_args = spy
name, target, heavy = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
module, _, function = target.partition(":")
sys.argv = [name, "--help"]
try:
    getattr(importlib.import_module(module), function)()
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
    assert module.startswith("ple_tools."), target
    return REPO / "tools" / f"{module.removeprefix('ple_tools.')}.py"


def probe(name: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", HELP_PROBE, name, SCRIPTS[name], ",".join(HEAVY)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    usage, _, result = proc.stdout.rpartition("\nPROBE ")
    return json.loads(result), usage


def test_every_script_is_a_tool_and_installed():
    assert set(SCRIPTS) == {"ple-demo", "ple-make-table", "ple-bench-gather", "ple-bench-warm",
                            "ple-bench-serving", "ple-bench-gpu", "ple-bench-layers",
                            "ple-tiny-model", "ple-bench-transformers",
                            "ple-bench-tensor-parallel", "ple-bench-prefill", "ple-bench-vllm"}
    for name, target in SCRIPTS.items():
        assert target.endswith(":main") and tool_file(target).is_file(), (name, target)
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")
                 if ep.dist is not None and ep.dist.name == "ple"}
    assert installed == SCRIPTS, "the installed ple is stale: reinstall it (make setup)"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_of_each_tool(name):
    info, usage = probe(name)
    assert info["code"] == 0, info
    assert usage.startswith(f"usage: {name} "), usage
    description = " ".join(info["description"].split())
    assert description[0].isupper() and description.endswith("."), description
    for option, text in info["options"]:
        assert text and text.strip(), f"{name} {option}: no help text"
    assert info["imported"] == [], f"{name} --help imported {info['imported']}"


def test_an_installed_console_script_runs():
    """One generated script, as a user runs it."""
    command = shutil.which("ple-make-table", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert command is not None, "ple-make-table is not installed next to this Python"
    proc = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0 and proc.stdout.startswith("usage: ple-make-table "), proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_a_tools_child_does_not_import_from_the_working_directory(tmp_path):
    """A clone's kernels/ folder, in the working directory, would hide the
    kernels package that transformers imports; the tools' children start
    without the working directory on sys.path."""
    from ple_tools.arm_child import module_command

    (tmp_path / "probe_module").mkdir()
    (tmp_path / "probe_module" / "__main__.py").write_text("print('from the working directory')")
    run = subprocess.run(module_command("probe_module"), cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 1
    assert run.stdout == ""
    assert "No module named probe_module" in run.stderr
