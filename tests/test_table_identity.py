"""A table's handle names the table, not a slot of one process: pickles,
copies, spawned workers, saved, exported and traced programs and compile
caches reach the same table (opened again on the same files) or raise an
error naming it, never another table's rows.  README "Tables in other
processes" and docs/tables.md."""

from __future__ import annotations

import copy
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import ple
from ple.layers import DiskEmbedding
from helpers import REPO, write_arange_table

TIMEOUT_S = 240


@pytest.fixture
def two_tables(tmp_path):
    """``wanted`` (rows of arange) and ``other`` (the same shape, negated),
    each the only tensor of its file."""
    wanted = write_arange_table(tmp_path / "wanted.safetensors", rows=64, cols=4, name="rows")
    other = tmp_path / "other.safetensors"
    save_file({"rows": -torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)}, str(other))
    return wanted, other


def run_python(script: str, *args, env: dict | None = None) -> str:
    """Runs ``script`` in a new interpreter (tests/ importable), with ``env``
    added to the environment; its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
                          capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=REPO / "tests", env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def expected_rows(ids: list[int]) -> torch.Tensor:
    return torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)[ids]


def test_handle_names_the_table_and_is_the_same_in_every_process(two_tables):
    wanted, _ = two_tables
    with ple.Table.from_safetensors(wanted) as table:
        assert isinstance(table.handle, str) and table.handle.startswith("rows@")
        elsewhere = run_python("""
            import sys, ple
            print(ple.Table.from_safetensors(sys.argv[1]).handle)
        """, wanted).strip()
        assert elsewhere == table.handle


def test_a_table_open_twice_has_two_handles_and_each_closes_alone(two_tables):
    wanted, _ = two_tables
    first = ple.Table.from_safetensors(wanted)
    second = ple.Table.from_safetensors(wanted)
    assert second.handle == f"{first.handle}#2"
    first.close()
    assert torch.equal(ple.gather(second, [5, 1]), expected_rows([5, 1]))
    second.close()


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
def test_a_copy_is_a_table_of_its_own(two_tables, how):
    wanted, _ = two_tables
    config = ple.GatherConfig(policy="all", threads=1)
    original = ple.Table.from_safetensors(wanted, config=config)
    original.place(host_rows=10, first_row=3)
    duplicate = {"deepcopy": copy.deepcopy, "copy": copy.copy,
                 "pickle": lambda t: pickle.loads(pickle.dumps(t))}[how](original)
    assert duplicate is not original and duplicate.handle != original.handle
    assert duplicate.config == config
    assert duplicate.resident_range == original.resident_range == (3, 13)
    del duplicate  # dropping the copy closes the copy only
    assert torch.equal(ple.gather(original, [4, 60]), expected_rows([4, 60]))
    original.close()


def test_a_deep_copied_module_keeps_working_when_the_original_closes(two_tables):
    wanted, _ = two_tables
    module = DiskEmbedding.from_safetensors(wanted)
    duplicate = copy.deepcopy(module)
    module.close()
    assert torch.equal(duplicate(torch.tensor([2, 7])), expected_rows([2, 7]))
    duplicate.close()


def test_a_closed_table_cannot_be_pickled(two_tables):
    wanted, _ = two_tables
    table = ple.Table.from_safetensors(wanted)
    table.close()
    with pytest.raises(ValueError, match=r"ple table 'rows' is closed: it cannot be pickled"):
        pickle.dumps(table)


def test_a_pickle_of_a_table_whose_files_changed_raises(tmp_path):
    path = write_arange_table(tmp_path / "t.safetensors", rows=64, cols=4, name="rows")
    blob = pickle.dumps(ple.Table.from_safetensors(path))
    write_arange_table(path, rows=32, cols=8, name="rows")
    with pytest.raises(ValueError, match=r"ple table 'rows' cannot be opened again as it was "
                                         r"pickled: .* now hold it with another layout"):
        pickle.loads(blob)


def test_torch_load_in_another_process_reads_the_saved_tables_files(two_tables, tmp_path):
    wanted, other = two_tables
    saved = tmp_path / "module.pt"
    torch.save(DiskEmbedding.from_safetensors(wanted), saved)
    # The other process opens a table of its own first: before handles named
    # their tables, the loaded module gathered that table's rows.
    got = run_python("""
        import sys, torch, ple
        mine = ple.Table.from_safetensors(sys.argv[2])
        module = torch.load(sys.argv[1], weights_only=False)
        print(module(torch.tensor([3, 9])).tolist())
    """, saved, other)
    assert got.strip() == str(expected_rows([3, 9]).tolist())


def _gather_in_worker(module, ids):
    return module(ids)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_module_sent_to_a_worker_gathers_its_own_table(two_tables, method):
    wanted, other = two_tables
    module = DiskEmbedding.from_safetensors(wanted)
    with multiprocessing.get_context(method).Pool(1) as pool:
        got = pool.apply_async(_gather_in_worker, (module, torch.tensor([1, 63]))).get(TIMEOUT_S)
    assert torch.equal(got, expected_rows([1, 63]))
    module.close()


class Gathers(torch.nn.Module):
    def __init__(self, handle: str):
        super().__init__()
        self.handle = handle

    def forward(self, ids):
        return torch.ops.ple.disk_gather(ids, self.handle) + 1


@pytest.mark.slow  # an export and a load in another process: about 10 s on 2 cores
def test_an_exported_program_gathers_its_table_or_names_it(two_tables, tmp_path):
    wanted, other = two_tables
    with ple.Table.from_safetensors(wanted) as table:
        program = torch.export.export(Gathers(table.handle), (torch.tensor([1, 2]),))
        torch.export.save(program, tmp_path / "program.pt2")
        handle = table.handle
    script = """
        import sys, torch, ple
        tables = [ple.Table.from_safetensors(p) for p in sys.argv[2:]]
        program = torch.export.load(sys.argv[1])
        try:
            print(program.module()(torch.tensor([4, 0])).tolist())
        except ValueError as error:
            print(error)
    """
    # The other table first, in another order than the exporting process.
    got = run_python(script, tmp_path / "program.pt2", other, wanted)
    assert got.strip() == str((expected_rows([4, 0]) + 1).tolist())
    got = run_python(script, tmp_path / "program.pt2", other)
    assert got.startswith(f"ple table 'rows' (handle {handle}) is not open in this process; the "
                          "table of that name open here")


@pytest.mark.slow  # a trace and a load in another process: about 6 s on 2 cores
def test_a_traced_program_gathers_its_table(two_tables, tmp_path):
    wanted, other = two_tables
    with ple.Table.from_safetensors(wanted) as table:
        traced = torch.jit.trace(Gathers(table.handle), (torch.tensor([1, 2]),))
        traced.save(str(tmp_path / "traced.pt"))
    got = run_python("""
        import sys, torch, ple
        tables = [ple.Table.from_safetensors(p) for p in sys.argv[2:]]
        print(torch.jit.load(sys.argv[1])(torch.tensor([5, 6])).tolist())
    """, tmp_path / "traced.pt", other, wanted)
    assert got.strip() == str((expected_rows([5, 6]) + 1).tolist())


@pytest.mark.slow  # two compiles over one cache: about 30 s on 2 cores
def test_a_warm_compile_cache_in_another_process_gathers_the_right_table(two_tables, tmp_path):
    wanted, other = two_tables
    script = """
        import os, sys, torch, ple
        tables = {p: ple.Table.from_safetensors(p) for p in sys.argv[1:]}
        table = tables[os.environ["WANTED"]]
        compiled = torch.compile(lambda ids: torch.ops.ple.disk_gather(ids, table.handle) * 2,
                                 fullgraph=True, dynamic=False)
        print(compiled(torch.tensor([8, 2])).tolist())
        from torch._dynamo.utils import counters
        print(dict(counters["inductor"]))
    """
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "WANTED": str(wanted)}
    want = str((expected_rows([8, 2]) * 2).tolist())
    first = run_python(script, wanted, other, env=env)
    second = run_python(script, other, wanted, env=env)  # the tables open in the other order
    assert first.splitlines()[0] == second.splitlines()[0] == want
    assert "'fxgraph_cache_hit': 1" in second.splitlines()[1], second

