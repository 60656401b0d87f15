"""tools/make_table.ensure_table reuses a table only when it was written,
to the end, with the same arguments."""

import pytest

import ple
from helpers import REPO, load_module

ARGUMENTS = dict(rows=100, row_bytes=16, shards=4, files=2, seed=0)


@pytest.fixture
def make_table(monkeypatch):
    """The tool's module, with write_table counting its calls in ``writes``."""
    module = load_module("make_table", REPO / "tools" / "make_table.py")
    module.writes = []
    write_table = module.write_table

    def counted(directory, **layout):
        module.writes.append(layout)
        return write_table(directory, **layout)

    monkeypatch.setattr(module, "write_table", counted)
    return module


def test_the_same_arguments_reuse_the_table(make_table, tmp_path):
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    assert make_table.writes == [ARGUMENTS]


@pytest.mark.parametrize("change", [{"shards": 1, "files": 1}, {"seed": 1}, {"rows": 99}])
def test_other_arguments_write_it_again(make_table, tmp_path, change):
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    make_table.ensure_table(tmp_path, **{**ARGUMENTS, **change})
    assert make_table.writes == [ARGUMENTS, {**ARGUMENTS, **change}]
    with ple.Table.from_safetensors(tmp_path, make_table.PREFIX) as table:
        assert table.num_rows == change.get("rows", 100)
    assert len(list(tmp_path.glob("*.safetensors"))) == change.get("files", 2)


def test_a_table_without_its_layout_file_is_written_again(make_table, tmp_path):
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    (tmp_path / make_table.LAYOUT_FILE).unlink()  # as after an interrupted write
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    assert make_table.writes == [ARGUMENTS, ARGUMENTS]
    assert (tmp_path / make_table.LAYOUT_FILE).exists()
