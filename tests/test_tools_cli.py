"""The tools' command lines: every console script of pyproject.toml is
installed and points at a ``main`` of ``ple_tools``; each tool's ``--help``
gives a description that is a whole sentence and a help text for every
option, and answers without importing torch (the tools are a package beside
``ple``, and each parses its arguments before any heavy import); every
numeric option refuses the values no run can use with argparse's usage
error, before the tool writes anything.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ple_tools import argtypes

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
    assert set(SCRIPTS) == {"ple-demo", "ple-make-table", "ple-quantize-table", "ple-bench-gather",
                            "ple-bench-warm", "ple-bench-serving", "ple-bench-gpu", "ple-bench-layers",
                            "ple-tiny-model", "ple-bench-transformers", "ple-bench-gemma4",
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
    """A folder in the working directory named like a package the child
    imports would hide it; the tools' children start without the working
    directory on sys.path."""
    from ple_tools.arm_child import module_command

    (tmp_path / "probe_module").mkdir()
    (tmp_path / "probe_module" / "__main__.py").write_text("print('from the working directory')")
    run = subprocess.run(module_command("probe_module"), cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 1
    assert run.stdout == ""
    assert "No module named probe_module" in run.stderr


# ---- values no run can use ----------------------------------------------------------

# Each shared argparse type, a value it refuses and its message, and values it takes.
ARGTYPES = [
    (argtypes.positive_int, "0", "expected an integer above 0, got '0'", {"1": 1, "07": 7}),
    (argtypes.non_negative_int, "-1", "expected an integer of 0 or more, got '-1'", {"0": 0}),
    (argtypes.positive_float, "nan", "expected a number above 0, got 'nan'", {"0.25": 0.25}),
    (argtypes.positive_float, "inf", "expected a number above 0, got 'inf'", {"1e3": 1000.0}),
    (argtypes.non_negative_float, "-0.5", "expected a number of 0 or more, got '-0.5'", {"0": 0.0}),
    (argtypes.number_above(1), "1", "expected a number above 1, got '1'", {"1.1": 1.1}),
    (argtypes.seed, str(2**64), f"expected an integer from 0 to 2**64 - 1, got '{2**64}'",
     {"0": 0, str(2**64 - 1): 2**64 - 1}),
    (argtypes.seed, "1.5", "expected an integer from 0 to 2**64 - 1, got '1.5'", {}),
    (argtypes.positive_int_list, "64,0", "expected integers above 0, comma separated, got '64,0'",
     {"64, 4096,": "64, 4096,", "": ""}),
]
# Values tried on each numeric option of each tool, the first its type refuses.
IMPOSSIBLE = ("0", "-1", "1", "nan", "x")
# The arguments a tool needs besides the option under test.
REQUIRED = {"ple-make-table": ["table"], "ple-quantize-table": ["checkpoint", "table.gguf"]}


@pytest.mark.parametrize("kind, refused, message, taken", ARGTYPES)
def test_argtypes_refuse_with_one_line_naming_what_they_take(kind, refused, message, taken):
    with pytest.raises(argparse.ArgumentTypeError) as error:
        kind(refused)
    assert str(error.value) == message
    assert {text: kind(text) for text in taken} == taken


def call_tool(name: str, arguments: list[str], monkeypatch, capsys) -> tuple[object, str]:
    """``name``'s main(arguments) in this process, as its console script
    calls it: its exit status (returned or raised) and its stderr."""
    module, _, function = SCRIPTS[name].partition(":")
    monkeypatch.setattr(sys, "argv", [name])
    try:
        status = getattr(importlib.import_module(module), function)(arguments)
    except SystemExit as exit:
        status = exit.code
    return status, capsys.readouterr().err


def tool_parser(name: str, monkeypatch, capsys) -> argparse.ArgumentParser:
    """The parser ``name`` builds, as its --help shows it."""
    parsers = []
    parse_known_args = argparse.ArgumentParser.parse_known_args

    def spy(self, args=None, namespace=None):
        parsers.append(self)
        return parse_known_args(self, args, namespace)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", spy)
        assert call_tool(name, ["--help"], monkeypatch, capsys)[0] == 0
    capsys.readouterr()
    return parsers[0]


def refusal(kind) -> tuple[str, str]:
    """The first of IMPOSSIBLE that ``kind`` refuses, and its message."""
    for value in IMPOSSIBLE:
        try:
            kind(value)
        except argparse.ArgumentTypeError as error:
            return value, str(error)
    raise AssertionError(f"{kind} takes all of {IMPOSSIBLE}")


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_numeric_option_refuses_what_no_run_can_use(name, tmp_path, monkeypatch, capsys):
    """Each option that takes a number takes it through a type of
    ple_tools.argtypes; given a value its type refuses, the tool exits 2
    with argparse's usage error, one line naming the option and what it
    takes, and writes nothing (its default directories are relative to the
    working directory)."""
    monkeypatch.chdir(tmp_path)
    options = {}
    for action in tool_parser(name, monkeypatch, capsys)._actions:
        assert action.type not in (int, float), (
            f"{name} {action.option_strings}: a plain {action.type.__name__}, not a type of "
            "ple_tools.argtypes")
        if getattr(action.type, "__module__", None) == argtypes.__name__:
            options[action.option_strings[0]] = action.type
    for option, kind in options.items():
        value, message = refusal(kind)
        status, err = call_tool(name, [*REQUIRED.get(name, []), option, value], monkeypatch,
                                capsys)
        assert status == 2, (option, value, err)
        assert err.startswith(f"usage: {name} "), err
        assert err.splitlines()[-1] == f"{name}: error: argument {option}: {message}", err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("arguments, line", [
    (["--mib", "-5"], "argument --mib: expected a number above 0, got '-5'"),
    (["--mib", "0"], "argument --mib: expected a number above 0, got '0'"),
    (["--row-bytes", "0"], "argument --row-bytes: expected an integer above 0, got '0'"),
    (["--shards", "0"], "argument --shards: expected an integer above 0, got '0'"),
    (["--files", "0"], "argument --files: expected an integer above 0, got '0'"),
    (["--seed", "-1"], "argument --seed: expected an integer from 0 to 2**64 - 1, got '-1'"),
    (["--mib", "inf"], "argument --mib: expected a number above 0, got 'inf'"),
    (["--mib", "0.0001"], "argument --mib: a table of 104 bytes holds no row of 160 bytes"),
])
def test_make_table_refuses_a_table_it_cannot_write(arguments, line, tmp_path):
    """The console script itself, as a user runs it: exit 2, the usage and
    one line of error, no directory."""
    command = shutil.which("ple-make-table", path=str(Path(sys.executable).parent))
    assert command is not None, "ple-make-table is not installed next to this Python"
    run = subprocess.run([command, str(tmp_path / "table"), *arguments], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("usage: ple-make-table ")
    assert run.stderr.splitlines()[-1] == f"ple-make-table: error: {line}"
    assert not (tmp_path / "table").exists()


def test_bench_transformers_refuses_an_unknown_arm_before_writing(tmp_path, monkeypatch, capsys):
    status, err = call_tool("ple-bench-transformers", ["--dir", str(tmp_path / "ckpt"),
                                                       "--arms", "ple,fast"], monkeypatch, capsys)
    assert status == 2
    assert err.splitlines()[-1] == ("ple-bench-transformers: error: argument --arms: unknown "
                                    "['fast']; arms: ple, in-memory, disk-offload")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_bench_vllm_without_vllm_says_how_to_install_it_before_writing(tmp_path, monkeypatch,
                                                                        capsys):
    status, err = call_tool("ple-bench-vllm", ["--dir", str(tmp_path / "ckpt")], monkeypatch,
                            capsys)
    assert status == 2
    assert err == (f"error: ple-bench-vllm runs vLLM, which {sys.executable} does not have: "
                   "install it with `pip install --no-build-isolation '.[vllm]'` from a checkout "
                   "of ple, or on a CPU machine run the tool with .venv-vllm's python, which "
                   "`make test-vllm` builds (docs/vllm.md)\n")
    assert not (tmp_path / "ckpt").exists()
