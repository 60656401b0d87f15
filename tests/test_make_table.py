"""tools/make_table.ensure_table reuses a table only when it was written,
to the end, with the same arguments."""

import importlib.util
from pathlib import Path

import pytest

import ple

TOOL = Path(__file__).resolve().parents[1] / "tools" / "make_table.py"


@pytest.fixture(scope="module")
def make_table():
    spec = importlib.util.spec_from_file_location("make_table", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def files_and_times(directory: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in directory.glob("*.safetensors")}


def test_the_same_arguments_reuse_the_table(make_table, tmp_path):
    make_table.ensure_table(tmp_path, rows=100, row_bytes=16, shards=4, files=2)
    written = files_and_times(tmp_path)
    make_table.ensure_table(tmp_path, rows=100, row_bytes=16, shards=4, files=2)
    assert files_and_times(tmp_path) == written


@pytest.mark.parametrize("change", [{"shards": 1, "files": 1}, {"seed": 1}, {"rows": 99}])
def test_other_arguments_write_it_again(make_table, tmp_path, change):
    arguments = dict(rows=100, row_bytes=16, shards=4, files=2, seed=0)
    make_table.ensure_table(tmp_path, **arguments)
    written = files_and_times(tmp_path)
    make_table.ensure_table(tmp_path, **{**arguments, **change})
    assert files_and_times(tmp_path) != written
    with ple.Table.from_safetensors(tmp_path, make_table.PREFIX) as table:
        assert table.num_rows == change.get("rows", 100)
    assert len(files_and_times(tmp_path)) == change.get("files", 2)


def test_a_table_without_its_layout_file_is_written_again(make_table, tmp_path):
    make_table.ensure_table(tmp_path, rows=100, row_bytes=16, shards=4, files=2)
    (tmp_path / make_table.LAYOUT_FILE).unlink()  # as after an interrupted write
    make_table.ensure_table(tmp_path, rows=100, row_bytes=16, shards=4, files=2)
    assert (tmp_path / make_table.LAYOUT_FILE).exists()
