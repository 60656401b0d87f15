"""tools/make_table.ensure_table (ple_tools.make_table) reuses a table only
when it was written, to the end, with the same arguments, and says so;
write_table shows a progress bar when asked."""

import pytest

import ple
import ple_tools.make_table

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


def test_a_table_without_its_layout_file_is_written_again(make_table, tmp_path):
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    (tmp_path / make_table.LAYOUT_FILE).unlink()  # as after an interrupted write
    make_table.ensure_table(tmp_path, **ARGUMENTS)
    assert make_table.writes == [ARGUMENTS, ARGUMENTS]
    assert (tmp_path / make_table.LAYOUT_FILE).exists()
