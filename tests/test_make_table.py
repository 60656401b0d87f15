"""tools/make_table.ensure_table (ple_tools.make_table) reuses a table only
when it was written, to the end, with the same arguments, and says so; it
deletes only the files its layout.json lists and refuses, before deleting
or writing anything, a directory that holds any other (the table tools'
command lines say so and exit 2); write_table shows a progress bar when
asked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch

import ple
import ple_tools.make_table
from helpers import REPO, directory_bytes, foreign_files_message, save_a_model
from ple_tools.written import ForeignFilesError, UnwritableError

ARGUMENTS = dict(rows=100, row_bytes=16, shards=4, files=2, seed=0)


@pytest.fixture
def make_table(monkeypatch):
    """The tool's module, with write_table counting its calls in ``writes``."""
    module = ple_tools.make_table
    monkeypatch.setattr(module, "writes", [], raising=False)
    write_table = module.write_table

    def counted(directory, **layout):
        module.writes.append(layout)
        return write_table(directory, **layout)

    monkeypatch.setattr(module, "write_table", counted)
    return module


def test_the_same_arguments_reuse_the_table(make_table, tmp_path, capsys):
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    assert "writing a table of 100 rows" in capsys.readouterr().err
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    assert make_table.writes == [ARGUMENTS]
    assert f"reusing the table in {tmp_path}" in capsys.readouterr().err


def test_write_table_progress(tmp_path, capsys):
    """With progress=True a tqdm bar counts the bytes; without one (stderr is
    not a terminal under pytest) a line per file says what was written."""
    ple_tools.make_table.write_table(tmp_path / "bar", rows=64, row_bytes=16, shards=2, files=2,
                                     progress=True)
    bar = capsys.readouterr().err
    assert "writing bar" in bar and "1.00k/1.00k" in bar and "[2/2]" in bar
    ple_tools.make_table.write_table(tmp_path / "lines", rows=64, row_bytes=16, shards=2, files=2)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == ["model-00001-of-00002.safetensors",
                                                   "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize("change", [{"shards": 1, "files": 1}, {"seed": 1}, {"rows": 99}])
def test_other_arguments_write_it_again(make_table, tmp_path, change):
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    make_table.ensure_table(tmp_path, **{**ARGUMENTS, **change})
    assert make_table.writes == [ARGUMENTS, {**ARGUMENTS, **change}]
    with ple.Table.from_safetensors(tmp_path, make_table.PREFIX) as table:
        assert table.num_rows == change.get("rows", 100)
    assert len(list(tmp_path.glob("*.safetensors"))) == change.get("files", 2)


def test_layout_json_lists_the_files_written(make_table, tmp_path):
    make_table.ensure_table(tmp_path / "a" / "b", **ARGUMENTS)  # a missing directory is made
    assert json.loads((tmp_path / "a" / "b" / "layout.json").read_text()) == {
        "written_by": "ple-make-table", "what": "a table", "complete": True,
        "files": ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
        "layout": ARGUMENTS}
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == [
        "layout.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_a_saved_model_is_refused_and_kept(make_table, tmp_path):
    """The issue: a saved model's model.safetensors was deleted."""
    save_a_model(tmp_path)
    before = directory_bytes(tmp_path)
    with pytest.raises(ForeignFilesError) as error:
        make_table.ensure_table(tmp_path, **ARGUMENTS)
    assert str(error.value) == (
        f"{tmp_path} holds 2 files that ple did not write (model.safetensors, notes.txt); ple "
        "writes its files only into a missing or empty directory, or one holding files it wrote "
        "there itself (listed in its layout.json), and deletes nothing else: name another "
        "directory, or move those files out")
    assert directory_bytes(tmp_path) == before
    assert make_table.writes == []


@pytest.mark.parametrize("change", [{}, {"seed": 1}, {"shards": 1, "files": 1}])
def test_a_file_beside_a_table_is_refused_and_kept(make_table, tmp_path, change):
    """Reusing the table or writing another one: either way a file ple did
    not write makes it refuse the directory, and nothing changes; at most
    three are named, sorted, a directory with a slash."""
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    save_a_model(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "log.txt").write_text("a run\n")
    (tmp_path / ".hidden").write_text("")
    before = directory_bytes(tmp_path)
    with pytest.raises(ForeignFilesError) as error:
        make_table.ensure_table(tmp_path, **{**ARGUMENTS, **change})
    assert str(error.value) == foreign_files_message(
        tmp_path, [".hidden", "model.safetensors", "notes.txt", "runs/"])
    assert "(.hidden, model.safetensors, notes.txt and 1 more)" in str(error.value)
    assert directory_bytes(tmp_path) == before
    assert make_table.writes == [ARGUMENTS]


def test_a_layout_json_ple_did_not_write_is_refused(make_table, tmp_path):
    (tmp_path / "layout.json").write_text('{"rows": "many"}')
    with pytest.raises(ForeignFilesError) as error:
        make_table.ensure_table(tmp_path, **ARGUMENTS)
    assert str(error.value) == foreign_files_message(tmp_path, ["layout.json"])
    assert (tmp_path / "layout.json").read_text() == '{"rows": "many"}'


def test_files_without_their_layout_json_are_refused(make_table, tmp_path):
    """Nothing says that ple wrote them (an older ple's interrupted write
    leaves a table so, and so does a copied checkpoint)."""
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    (tmp_path / "layout.json").unlink()
    with pytest.raises(ForeignFilesError) as error:
        make_table.ensure_table(tmp_path, **ARGUMENTS)
    assert str(error.value) == foreign_files_message(
        tmp_path, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])


def test_a_path_that_is_a_file_is_refused(make_table, tmp_path):
    (tmp_path / "table").write_text("x")
    with pytest.raises(UnwritableError, match=f"^{tmp_path / 'table'} is not a directory: name "
                       r"a directory for the tool to write into \(a missing one is created\)$"):
        make_table.ensure_table(tmp_path / "table", **ARGUMENTS)


def test_an_interrupted_write_is_written_again(make_table, tmp_path, monkeypatch):
    """Cut short after its first file (the second one half written), a
    write leaves a layout.json that lists both files and says it is
    incomplete: the next call deletes and writes them again; a file ple did
    not write beside them is still refused."""
    make_table.ensure_table(tmp_path, **{**ARGUMENTS, "seed": 1})
    save_file = safetensors.torch.save_file
    calls = []

    def cut_short(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as handle:
                handle.write(b"half")
            raise KeyboardInterrupt
        return save_file(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", cut_short)
    with pytest.raises(KeyboardInterrupt):
        make_table.ensure_table(tmp_path, **ARGUMENTS)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    marker = json.loads((tmp_path / "layout.json").read_text())
    assert marker["complete"] is False and marker["layout"] == ARGUMENTS
    assert marker["files"] == ["model-00001-of-00002.safetensors",
                               "model-00002-of-00002.safetensors"]

    (tmp_path / "mine.txt").write_text("mine")
    before = directory_bytes(tmp_path)
    with pytest.raises(ForeignFilesError) as error:
        make_table.ensure_table(tmp_path, **ARGUMENTS)
    assert str(error.value) == foreign_files_message(tmp_path, ["mine.txt"])
    assert directory_bytes(tmp_path) == before
    (tmp_path / "mine.txt").unlink()

    make_table.ensure_table(tmp_path, **ARGUMENTS)
    assert make_table.writes == [{**ARGUMENTS, "seed": 1}, ARGUMENTS, ARGUMENTS]
    assert json.loads((tmp_path / "layout.json").read_text())["complete"] is True
    with ple.Table.from_safetensors(tmp_path, make_table.PREFIX) as table:
        assert table.num_rows == ARGUMENTS["rows"]


def test_a_table_of_an_older_ple_is_reused_and_replaced(make_table, tmp_path):
    """An older ensure_table's layout.json held the arguments alone, written
    after the files, whose names they give: the table is reused, and
    replaced by one of other arguments without a stray file."""
    make_table.write_table(tmp_path, **{**ARGUMENTS, "files": 4})
    (tmp_path / "layout.json").write_text(json.dumps({**ARGUMENTS, "files": 4}))
    make_table.ensure_table(tmp_path, **{**ARGUMENTS, "files": 4})
    assert make_table.writes == [{**ARGUMENTS, "files": 4}]  # write_table's own call only
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "layout.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_the_command_line_says_so_and_exits_2(tmp_path):
    """``ple-make-table DIR``: the error on stderr, no traceback, nothing
    written or deleted."""
    save_a_model(tmp_path)
    before = directory_bytes(tmp_path)
    run = subprocess.run([sys.executable, str(REPO / "tools" / "make_table.py"), str(tmp_path),
                          "--mib", "0.01"], capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout) == (2, "")
    message = foreign_files_message(tmp_path, ["model.safetensors", "notes.txt"])
    assert run.stderr == f"error: {message}\n"
    assert directory_bytes(tmp_path) == before


# Each table tool's console script and the options that keep its other
# checks quiet.
TABLE_TOOLS = [("ple-demo", []), ("ple-bench-gather", ["--quick"]), ("ple-bench-warm", []),
               ("ple-bench-serving", []), ("ple-bench-layers", []), ("ple-bench-gpu", []),
               ("ple-bench-tensor-parallel", ["--device", "cpu"]),
               ("ple-bench-prefill", ["--quick", "--device", "cpu"])]
HEAVY = {"torch", "numpy", "ple", "safetensors", "transformers"}


def run_script(name: str, arguments: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """A console script as a user runs it, and the heavy modules it imported."""
    run = subprocess.run([str(Path(sys.executable).with_name(name)), *arguments],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines()
                if line.startswith("import time:")}
    run.stderr = "".join(line for line in run.stderr.splitlines(keepends=True)
                         if not line.startswith("import time:"))
    return run, imported & HEAVY


@pytest.mark.parametrize("tool, options", TABLE_TOOLS)
def test_every_table_tool_refuses_a_saved_model_before_importing_torch(tool, options, tmp_path):
    """Each tool's ``--table DIR``: the error, exit status 2, nothing written
    or deleted, in a fraction of a second (the check comes before torch)."""
    save_a_model(tmp_path)
    before = directory_bytes(tmp_path)
    run, heavy = run_script(tool, ["--table", str(tmp_path), *options])
    assert (run.returncode, run.stdout) == (2, ""), run.stderr
    assert run.stderr == (
        f"error: {foreign_files_message(tmp_path, ['model.safetensors', 'notes.txt'])}\n")
    assert heavy == set()
    assert directory_bytes(tmp_path) == before


def record_of(tool: str, what: str, files: list[str]) -> str:
    return json.dumps({"written_by": tool, "what": what, "complete": True, "files": files})


def test_a_table_tool_names_a_checkpoint_another_tool_wrote(tmp_path):
    """A directory of ple-bench-transformers' is no table: the error says
    whose it is and what the tool writes, not that ple did not write it."""
    (tmp_path / "model-small.safetensors").write_text("")
    (tmp_path / "ple_bench.json").write_text(
        record_of("ple-bench-transformers", "a checkpoint", ["model-small.safetensors"]))
    (tmp_path / "notes.txt").write_text("")
    before = directory_bytes(tmp_path)
    run, heavy = run_script("ple-demo", ["--table", str(tmp_path)])
    assert (run.returncode, run.stdout, heavy) == (2, "", set())
    assert run.stderr == (
        f"error: {tmp_path} holds a checkpoint that ple-bench-transformers wrote there (its "
        "ple_bench.json lists the files), and 1 other file; ple writes a table only into a "
        "missing or empty directory, or one holding a table that it wrote there itself (listed "
        "in its layout.json), and deletes nothing else: name another directory\n")
    assert directory_bytes(tmp_path) == before


@pytest.mark.parametrize("tool, option, what, marker", [
    ("ple-bench-transformers", "--dir", "a checkpoint", "ple_bench.json"),
    ("ple-tiny-model", "--out", "the tiny model's tables", "ple_tiny_model.json")])
def test_a_tool_names_a_table_ple_make_table_wrote(tool, option, what, marker, make_table,
                                                    tmp_path):
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    before = directory_bytes(tmp_path)
    run, heavy = run_script(tool, [option, str(tmp_path)])
    assert (run.returncode, run.stdout, heavy) == (2, "", set())
    assert run.stderr == (
        f"error: {tmp_path} holds a table that ple-make-table wrote there (its layout.json lists "
        f"the files); ple writes {what} only into a missing or empty directory, or one holding "
        f"{what} that it wrote there itself (listed in its {marker}), and deletes nothing else: "
        "name another directory\n")
    assert directory_bytes(tmp_path) == before


def test_bench_transformers_refuses_a_saved_model(tmp_path):
    """``ple-bench-transformers --dir DIR`` writes its checkpoint by the same
    rule (its ple_bench.json lists the files)."""
    save_a_model(tmp_path)
    before = directory_bytes(tmp_path)
    run, heavy = run_script("ple-bench-transformers", ["--dir", str(tmp_path), "--table-gib",
                                                       "0.001"])
    assert (run.returncode, run.stdout, heavy) == (2, "", set())
    message = foreign_files_message(tmp_path, ["model.safetensors", "notes.txt"], "ple_bench.json")
    assert run.stderr == f"error: {message}\n"
    assert directory_bytes(tmp_path) == before


def test_bench_transformers_reuses_an_older_checkpoint(tmp_path):
    """An older ple_bench.json (no file list, written last) names its files
    by its tables and shards: the checkpoint is reused, and a file beside
    it is refused."""
    import torch

    from ple_tools import bench_transformers

    info = {"table_bytes": 160, "tables": {"model.layers.1.ple.ngram_embedding": [10, 8]},
            "dtype": "bfloat16", "requested_bytes": 1000.0, "ple_layers": 1, "shards": 2, "seed": 0}
    for name in ["model-layers-1-ple-ngram_embedding-00000.safetensors",
                 "model-layers-1-ple-ngram_embedding-00001.safetensors", "model-small.safetensors",
                 "model.safetensors.index.json", "config.json"]:
        (tmp_path / name).write_text("")
    (tmp_path / "ple_bench.json").write_text(json.dumps(info))
    assert bench_transformers.ensure_checkpoint(tmp_path, 1000.0, torch.bfloat16, 1) == info
    (tmp_path / "model.safetensors").write_text("")
    with pytest.raises(ForeignFilesError) as error:
        bench_transformers.ensure_checkpoint(tmp_path, 1000.0, torch.bfloat16, 1)
    assert str(error.value) == foreign_files_message(tmp_path, ["model.safetensors"],
                                                     "ple_bench.json")


@pytest.mark.parametrize("layout, what", [
    ({"rows": 10, "shards": 11, "files": 1}, "shards"),
    ({"rows": 10, "shards": 2, "files": 3}, "files"),
    ({"rows": 10**15, "row_bytes": 1, "shards": 10**7, "files": 1}, "shards")])
def test_ensure_table_refuses_a_table_it_cannot_write_before_writing(make_table, layout, what,
                                                                      tmp_path):
    """ensure_table itself, as the tools call it once their arguments pass:
    the same checks (tests/test_tools_cli.py has their messages)."""
    with pytest.raises(make_table.LayoutError) as error:
        make_table.ensure_table(tmp_path / "table", **{"row_bytes": 16, **layout})
    assert error.value.what == what
    assert not (tmp_path / "table").exists() and make_table.writes == []
