"""The tools' command lines: every console script of pyproject.toml is
installed and points at a ``main`` of ``ple_tools``; each tool's ``--help``
gives a description that is a whole sentence and a help text for every
option, and answers without importing torch (the tools are a package beside
``ple``, and each parses its arguments before any heavy import); every
numeric option refuses the values no run can use with argparse's usage
error, before the tool writes anything: beside the values its type refuses,
the library's limits (which ple_tools.argtypes spells out: they are checked
to be the library's), a table that cannot be written (its shards, files,
header, room on the disk, memory), a path nothing can be written under, a
device torch does not see.
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
    (argtypes.gather_threads, "257",
     "expected an integer from 1 to 256 (GatherConfig.threads), got '257'", {"1": 1, "256": 256}),
    (argtypes.row_cache_mib, str(2**40 + 1), f"expected an integer from 0 to 2**40 "
     f"(GatherConfig.row_cache_mib), got '{2**40 + 1}'", {"0": 0, str(2**40): 2**40}),
    (argtypes.window_kib, "-1", "expected an integer from 0 to 2**40 "
     "(GatherConfig.prefetch_window_kib), got '-1'", {"0": 0}),
    (argtypes.io_queue_depth, "1025", "expected an integer from 1 to 1024 "
     "(GatherConfig.io_queue_depth), got '1025'", {"1024": 1024}),
    (argtypes.io_block_bytes, "3", "expected a power of two from 1 to 65536 "
     "(GatherConfig.io_block_bytes), got '3'", {"512": 512, "65536": 65536}),
    (argtypes.io_block_bytes, "131072", "expected a power of two from 1 to 65536 "
     "(GatherConfig.io_block_bytes), got '131072'", {}),
    (argtypes.lookahead_mib, "257", "expected an integer from 1 to 256 (what a table's "
     "prefetches hold at most), got '257'", {"256": 256}),
    (argtypes.io_block_bytes_list, "4096,3", "expected powers of two from 1 to 65536 "
     "(GatherConfig.io_block_bytes), comma separated, got '4096,3'", {"4096,512": "4096,512"}),
    (argtypes.row_cache_mib_list, "16,0", "expected integers from 1 to 2**40 "
     "(GatherConfig.row_cache_mib), comma separated, got '16,0'", {"16": "16"}),
    (argtypes.policy_spec, "windo", "expected a policy of window, distance, all, none, or "
     "policy:KiB with KiB from 0 to 2**40, got 'windo'", {"window": "window", "all:64": "all:64"}),
    (argtypes.policy_spec, f"window:{2**40 + 1}", "expected a policy of window, distance, all, "
     f"none, or policy:KiB with KiB from 0 to 2**40, got 'window:{2**40 + 1}'", {}),
    (argtypes.policy_spec, "window:" + "9" * 5000, "expected a policy of window, distance, all, "
     f"none, or policy:KiB with KiB from 0 to 2**40, got 'window:{'9' * 5000}'", {}),
    (argtypes.fraction_pair, "nan,0", "expected two fractions of 0 or more whose sum is at most "
     "1, comma separated, got 'nan,0'", {"0.5,0.5": (0.5, 0.5), "0,0": (0.0, 0.0)}),
    (argtypes.fraction_pair, "0.6,0.6", "expected two fractions of 0 or more whose sum is at "
     "most 1, comma separated, got '0.6,0.6'", {}),
    (argtypes.seconds, "1e300", "expected a number of seconds above 0, at most 9223372036, got "
     "'1e300'", {"600": 600.0}),
    (argtypes.milliseconds, "inf", "expected a number of milliseconds of 0 or more, at most "
     "9223372036000, got 'inf'", {"0": 0.0, "50": 50.0}),
]
# Values tried on each numeric option of each tool: every one its type refuses.
IMPOSSIBLE = ("0", "-1", "1", "nan", "x", "257", "1025", "3", "1e300", "nan,0", str(2**41))
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


def refusals(kind) -> dict[str, str]:
    """Each of IMPOSSIBLE that ``kind`` refuses, and its message."""
    refused = {}
    for value in IMPOSSIBLE:
        try:
            kind(value)
        except argparse.ArgumentTypeError as error:
            refused[value] = str(error)
    assert refused, f"{kind} takes all of {IMPOSSIBLE}"
    return refused


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_numeric_option_refuses_what_no_run_can_use(name, tmp_path, monkeypatch, capsys):
    """Each option that takes a number takes it through a type of
    ple_tools.argtypes; given any value its type refuses, the tool exits 2
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
        for value, message in refusals(kind).items():
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


# ---- the library's limits, and what a run needs beyond its types ---------------------

def test_the_limits_of_argtypes_are_the_library_s():
    """ple_tools.argtypes spells out the library's limits so that a tool
    refuses a value before it imports torch: they must be the library's."""
    import ple
    from ple.kernels.native import native
    from ple.layers import lookahead
    from ple.safetensors_header import MAX_HEADER_BYTES

    from ple_tools import make_table

    assert ple.config.RANGES == {
        "prefetch_window_kib": (0, argtypes.MAX_PREFETCH_WINDOW_KIB),
        "threads": (1, argtypes.MAX_THREADS), "row_cache_mib": (0, argtypes.MAX_ROW_CACHE_MIB),
        "io_queue_depth": (1, argtypes.MAX_IO_QUEUE_DEPTH),
        "io_block_bytes": (0, argtypes.MAX_IO_BLOCK_BYTES)}
    assert native.MAX_THREADS == argtypes.MAX_THREADS
    assert ple.config.POLICIES == argtypes.POLICIES
    assert lookahead.MOST_BYTES == argtypes.MAX_LOOKAHEAD_MIB << 20
    assert make_table.MAX_HEADER_BYTES == MAX_HEADER_BYTES


GiB = 2**30


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """The working directory an empty tmp_path, on a machine of 16 GiB of
    memory whose filesystems have 100 GiB free (what the messages name)."""
    sysconf = os.sysconf

    def fake_sysconf(name):
        if name == "SC_PHYS_PAGES":
            return 16 * GiB // sysconf("SC_PAGE_SIZE")
        return sysconf(name)

    monkeypatch.setattr(os, "sysconf", fake_sysconf)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(
        1000 * GiB, 900 * GiB, 100 * GiB))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


NEEDS_TRANSFORMERS = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")
# A tool, its arguments, and the end of its usage error's last line.
BEYOND_TYPES = [
    ("ple-make-table", ["table", "--shards", "1000000000000"], "argument --shards: "
     "1,000,000,000,000 shards for a table of 1,677,721 rows: a shard holds one row at least"),
    ("ple-make-table", ["table", "--files", "1000000000000"], "argument --files: "
     "1,000,000,000,000 files for the 8 shards that get rows: a file holds one shard at least"),
    ("ple-make-table", ["table", "--row-bytes", "1", "--shards", "1000000", "--files", "1"],
     "argument --shards: 1,000,000 shards over 1 file make a safetensors header of up to 105.6 "
     "MiB in a file, more than the 100.0 MiB that ple reads: ask for fewer shards or more files"),
    ("ple-make-table", ["table", "--mib", "1e12"], "argument --mib: a table of 931.3 PiB does "
     "not fit in table: its filesystem has 100.0 GiB free"),
    ("ple-make-table", ["table", "--mib", "20000", "--files", "1"], "argument --files: writing "
     "a file of the table takes up to 24.4 GiB of memory (its rows are made whole before it is "
     "written), more than this machine's 16.0 GiB: ask for more files"),
    ("ple-make-table", ["table", "--mib", "60000", "--shards", "2", "--files", "2"],
     "argument --shards: writing a file of the table takes up to 87.9 GiB of memory (its rows "
     "are made whole before it is written), more than this machine's 16.0 GiB: ask for more "
     "shards, and files to spread them over"),
    ("ple-demo", ["--mib", "1e12"], "argument --mib: a table of 931.3 PiB does not fit in "
     "data/demo_table: its filesystem has 100.0 GiB free"),
    ("ple-demo", ["--rows", "100000000000"], "argument --rows: 8 calls of 100,000,000,000 ids "
     "(and a call's rows) takes 34.9 TiB of memory, more than this machine's 16.0 GiB"),
    ("ple-bench-gather", ["--table-rows", str(10**15)], "argument --table-rows: a table of "
     "142.1 PiB does not fit in data/bench_table: its filesystem has 100.0 GiB free"),
    ("ple-bench-gather", ["--quick", "--cpu-load", "100000"], "argument --cpu-load: 100,000 busy "
     "Python processes takes 1.5 TiB of memory, more than this machine's 16.0 GiB"),
    ("ple-bench-gather", ["--memory-limit", "20000"], "argument --memory-limit: a cap of 19.5 "
     "GiB caps nothing on this machine of 16.0 GiB"),
    ("ple-bench-gather", ["--table-gib", "40"], "argument --files: writing a file of the table "
     "takes up to 20.0 GiB of memory (its rows are made whole before it is written), more than "
     "this machine's 16.0 GiB: ask for more files"),
    ("ple-bench-serving", ["--budget", "2199023255552"], "argument --budget: a budget of "
     "2,199,023,255,552 MiB takes 2.0 EiB of memory, more than this machine's 16.0 GiB"),
    ("ple-bench-serving", ["--zipf", "1.0001"], "argument --zipf: 1.0001 is so near 1 that 0.18% "
     "of the distribution's draws fall in the table's 26,843,545 rows: drawing the ids would "
     "take 566 draws an id"),
    ("ple-bench-serving", ["--warmup", "10000000000"], "argument --rows: 10,000,000,300 calls of "
     "4,096 ids takes 298.0 TiB of memory, more than this machine's 16.0 GiB"),
    ("ple-bench-warm", ["--table-gib", "1e9"], "argument --table-gib: a table of 953.7 PiB does "
     "not fit in data/bench_warm_table: its filesystem has 100.0 GiB free"),
    ("ple-bench-warm", ["--cxx", "no-such-compiler"], "argument --cxx: no program "
     "'no-such-compiler' (neither an executable file nor a command on PATH)"),
    ("ple-bench-warm", ["--python", "no-such-python"], "argument --python: no program "
     "'no-such-python' (neither an executable file nor a command on PATH)"),
    ("ple-bench-warm", ["--rows", "1000000000"], "argument --rows: 50 calls of 1,000,000,000 ids "
     "takes 1.2 TiB of memory, more than this machine's 16.0 GiB"),
    ("ple-bench-layers", ["--table-gib", "0.001"], "argument --table-gib: the layer's hashing (16 "
     "heads of primes from 394) takes 7,056 rows, more than the table's 6,710"),
    ("ple-bench-layers", ["--tokens", "10000000"], "argument --tokens: 3 modes of 8 steps of "
     "10,000,000 tokens takes 1.1 TiB of memory, more than this machine's 16.0 GiB"),
    ("ple-bench-gpu", ["--mib", "20000"], "argument --mib: writing a file of the table takes up "
     "to 58.6 GiB of memory (its rows are made whole before it is written), more than this "
     "machine's 16.0 GiB: ask for a smaller table"),
    ("ple-bench-tensor-parallel", ["--device", "cpu", "--mib", "1e12"], "argument --mib: a table "
     "of 931.3 PiB does not fit in data/tp_bench_table: its filesystem has 100.0 GiB free"),
    ("ple-bench-tensor-parallel", ["--device", "cpu", "--world-size", "100"], "argument "
     "--world-size: 100 ranks (a process with torch each) takes 50.0 GiB of memory, more than "
     "this machine's 16.0 GiB"),
    pytest.param("ple-bench-prefill", ["--quick", "--device", "cpu", "--model-layers", "3",
                                       "--model-hidden", "100000"],
                 "argument --model-hidden: a model of 3 layers, 100,000 wide, 64 experts (its "
                 "bfloat16 weights) takes 3.3 TiB of memory, more than this machine's 16.0 GiB",
                 marks=NEEDS_TRANSFORMERS),  # its weights are counted from transformers' config
    ("ple-bench-prefill", ["--ngram-base", str(10**15)], "argument --ngram-base: a table of "
     "2.2 EiB does not fit in data/bench_prefill: its filesystem has 100.0 GiB free"),
    ("ple-bench-prefill", ["--quick", "--arms", "window,nothing"], "argument --arms: unknown arm "
     "'nothing': arms are window, all, direct, direct-cache:MiB, lookahead and lookahead-<arm>, "
     "and with --model-layers compute, reads and reads-<arm>"),
    ("ple-bench-prefill", ["--quick", "--arms", "compute"], "argument --arms: the compute arm "
     "needs --model-layers"),
    ("ple-bench-prefill", ["--quick", "--model-layers", "2"], "argument --model-layers: 3 or "
     "more (the PLE layer is decoder layer 2, and a full-attention layer must follow)"),
    ("ple-bench-prefill", ["--quick", "--caches", "100000"], "argument --caches: a row cache of "
     "100,000 MiB takes 97.7 GiB of memory, more than this machine's 16.0 GiB"),
    ("ple-bench-prefill", ["--quick", "--tokens-count", "1000000000"], "argument --tokens-count: "
     "a prompt of 1,000,000,000 tokens takes 238.4 GiB of memory, more than this machine's "
     "16.0 GiB"),
    ("ple-bench-transformers", ["--prompt", "40000"], "argument --prompt: 40,000 tokens, then 33 "
     "generated, are more than the model's 32,768 positions"),
    ("ple-bench-transformers", ["--table-gib", "1e9"], "argument --table-gib: a checkpoint of "
     "953.7 PiB does not fit in data/bench_transformers: its filesystem has 100.0 GiB free"),
    ("ple-bench-vllm", ["--prompt", "1000"], "argument --prompt: 1,000 tokens and 32 new ones "
     "(and 8 of room) are more than the model's 1,024 positions"),
    ("ple-bench-vllm", ["--table-gib", "100"], "argument --table-gib: writing the checkpoint (its "
     "table in float32, in bfloat16, and read back) takes 500.0 GiB of memory, more than this "
     "machine's 16.0 GiB"),
]
ON_A_GPU = [
    ("ple-tiny-model", ["--device", "cuda"], "argument --device: cuda, and torch {torch} sees no "
     "CUDA device (--device cpu runs on the CPU)"),
    ("ple-bench-prefill", ["--quick", "--device", "cuda"], "argument --device: cuda, and torch "
     "{torch} sees no CUDA device"),
    ("ple-bench-tensor-parallel", [], "argument --device: cuda, and torch {torch} sees no CUDA "
     "device (--device cpu runs on the CPU)"),
]


def refused(name: str, arguments: list[str], monkeypatch, capsys) -> str:
    """The last line of ``name``'s usage error for ``arguments``, which it
    must refuse with exit status 2."""
    status, err = call_tool(name, arguments, monkeypatch, capsys)
    assert status == 2, err
    assert err.startswith(f"usage: {name} "), err
    last = err.splitlines()[-1]
    assert last.startswith(f"{name}: error: "), err
    return last.removeprefix(f"{name}: error: ")


@pytest.mark.parametrize("name, arguments, line", BEYOND_TYPES, ids=[
    f"{n} {' '.join(a)}" for n, a, _ in (getattr(case, "values", case) for case in BEYOND_TYPES)])
def test_a_value_its_type_takes_and_no_run_can_use_is_refused_before_writing(
        name, arguments, line, machine, monkeypatch, capsys):
    """The library's limits, the table's layout, room and memory, and what
    a run needs of the machine, checked once the arguments are parsed."""
    assert refused(name, arguments, monkeypatch, capsys) == line
    assert list(machine.iterdir()) == []


@pytest.mark.skipif("not no_cuda()", reason="torch sees a CUDA device")
@pytest.mark.parametrize("name, arguments, line", ON_A_GPU)
def test_a_device_torch_does_not_see_is_refused_before_writing(name, arguments, line, machine,
                                                                monkeypatch, capsys):
    import torch

    assert refused(name, arguments, monkeypatch, capsys) == line.format(torch=torch.__version__)
    assert list(machine.iterdir()) == []


# Each tool's options that name what it writes: a directory (True) or a file.
OUTPUTS = {
    "ple-make-table": [("directory", True)],
    "ple-demo": [("--table", True), ("--json", False)],
    "ple-bench-gather": [("--table", True), ("--json", False), ("--plot", False)],
    "ple-bench-serving": [("--table", True), ("--json", False)],
    "ple-bench-warm": [("--table", True), ("--json", False)],
    "ple-bench-layers": [("--table", True), ("--json", False)],
    "ple-bench-gpu": [("--table", True), ("--json", False)],
    "ple-bench-tensor-parallel": [("--table", True), ("--json", False)],
    "ple-bench-prefill": [("--table", True), ("--json", False), ("--save-text", False),
                          ("--save-tokens", False)],
    "ple-bench-transformers": [("--dir", True), ("--offload-dir", True), ("--json", False)],
    "ple-bench-vllm": [("--dir", True), ("--json", False)],
    "ple-tiny-model": [("--out", True)],
    "ple-quantize-table": [("output", False)],
    "ple-bench-gemma4": [("--dir", True), ("--json", False)],
}
# The positional arguments before a tool's positional output.
BEFORE = {"ple-quantize-table": ["checkpoint"]}
# The arguments that keep a tool's other checks quiet (a small table, the CPU).
QUIET = {"ple-bench-gather": ["--quick"], "ple-bench-prefill": ["--quick", "--device", "cpu"],
         "ple-bench-tensor-parallel": ["--device", "cpu"]}


def test_every_tool_that_writes_is_listed():
    assert set(OUTPUTS) == set(SCRIPTS)


@pytest.mark.parametrize("name, option, directory", [
    (name, option, directory) for name, outputs in sorted(OUTPUTS.items())
    for option, directory in outputs])
def test_a_path_nothing_can_be_written_under_is_refused_before_writing(
        name, option, directory, tmp_path, monkeypatch, capsys):
    """A path under a file, and one under /proc: argparse's usage error
    naming the option, and nothing written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine\n")
    for path, reason in [("afile/sub", f"{tmp_path / 'afile'} is not a directory, so nothing "
                          "can be made under it"),
                         ("/proc/ple-probe/sub", "no file can be written in /proc (")]:
        arguments = ([*BEFORE.get(name, []), path] if not option.startswith("--")
                     else [option, path])
        line = refused(name, [*arguments, *QUIET.get(name, [])], monkeypatch, capsys)
        assert line.startswith(f"argument {option}: {reason}"), line
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]
    assert (tmp_path / "afile").read_text() == "mine\n"
    if directory:  # and a file where the directory would be
        line = refused(name, [*([] if not option.startswith("--") else [option]), "afile",
                              *QUIET.get(name, [])], monkeypatch, capsys)
        assert line.startswith(f"argument {option}: afile is not a directory"), line
