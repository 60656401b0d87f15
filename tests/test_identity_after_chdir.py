"""A table opened by a relative path, or through a symlink, is the file it
opened: after ``os.chdir`` into a directory that holds another file of
that name (or once the link names another file), every route that opens
the table again (copy, deepcopy, pickle, torch.save and torch.load, a
spawned worker, an exported program) gathers the first file's rows.  A
table resolves its paths once, at open (docs/reliability.md)."""

from __future__ import annotations

import copy
import io
import multiprocessing
import os
import pickle

import gguf
import pytest
import torch
from safetensors.torch import save_file

import ple
from ple.layers import DiskEmbedding, PackedGGUFEmbedding
from helpers import write_gguf

ROWS, COLS = 64, 32
TIMEOUT_S = 240
IDS = [3, 0, 63, 17]


def values(sign: float) -> torch.Tensor:
    return sign * torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


@pytest.fixture
def opened_here(tmp_path, monkeypatch):
    """``first/`` and ``second/``, each with ``t.safetensors`` and ``t.gguf``
    of one shape: rows of arange in ``first``, negated in ``second``.  The
    working directory is ``first``."""
    for name, sign in (("first", 1.0), ("second", -1.0)):
        directory = tmp_path / name
        directory.mkdir()
        save_file({"t": values(sign)}, str(directory / "t.safetensors"))
        write_gguf(directory / "t.gguf",
                   {"t": (values(sign).numpy(), gguf.GGMLQuantizationType.F32)})
    monkeypatch.chdir(tmp_path / "first")
    return tmp_path


def open_modules() -> dict[str, torch.nn.Module]:
    """A layer over each file of the working directory, by relative paths."""
    return {"safetensors": DiskEmbedding.from_safetensors("t.safetensors"),
            "directory": DiskEmbedding.from_safetensors("."),
            "gguf": PackedGGUFEmbedding("t.gguf", "t", dtype=torch.float32)}


def gathered(module: torch.nn.Module) -> torch.Tensor:
    return module(torch.tensor(IDS))


def torch_round_trip(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# Each route's rows of IDS from a copy of a module.
ROUTES = {
    "deepcopy": lambda module: gathered(copy.deepcopy(module)),
    "copy of the table": lambda module: ple.gather(copy.copy(module.table), IDS),
    "pickle": lambda module: gathered(pickle.loads(pickle.dumps(module))),
    "torch.save": lambda module: gathered(torch_round_trip(module)),
}


def test_paths_are_absolute_and_real(opened_here):
    for module in open_modules().values():
        assert module.table.paths == [opened_here.resolve() / "first" / module.table.paths[0].name]
        assert all(path.is_absolute() for path in module.table.paths)


@pytest.mark.parametrize("route", ROUTES)
def test_every_copy_after_chdir_gathers_the_file_opened(opened_here, route):
    modules = open_modules()
    os.chdir(opened_here / "second")
    want = values(1.0)[IDS]
    for kind, module in modules.items():
        got = ROUTES[route](module)
        assert torch.equal(got, want), (kind, got[:, 0])


def test_a_copy_after_the_link_moves_gathers_the_file_opened(opened_here):
    link = opened_here / "link.safetensors"
    link.symlink_to(opened_here / "first" / "t.safetensors")
    module = DiskEmbedding.from_safetensors(link)
    link.unlink()
    link.symlink_to(opened_here / "second" / "t.safetensors")
    assert torch.equal(gathered(copy.deepcopy(module)), values(1.0)[IDS])
    assert torch.equal(gathered(torch_round_trip(module)), values(1.0)[IDS])


def _gather_in_worker(module, ids):
    return module(ids)


def test_a_worker_spawned_after_chdir_gathers_the_file_opened(opened_here):
    modules = open_modules()
    os.chdir(opened_here / "second")  # the worker starts here
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = {kind: pool.apply_async(_gather_in_worker, (module, torch.tensor(IDS)))
               for kind, module in modules.items()}
        got = {kind: result.get(TIMEOUT_S) for kind, result in got.items()}
    for kind, rows in got.items():
        assert torch.equal(rows, values(1.0)[IDS]), kind


class Gathers(torch.nn.Module):
    def __init__(self, handle: str):
        super().__init__()
        self.handle = handle

    def forward(self, ids):
        return torch.ops.ple.disk_gather(ids, self.handle)


def test_an_exported_program_after_chdir_gathers_the_file_opened(opened_here):
    table = ple.Table.from_safetensors("t.safetensors")
    os.chdir(opened_here / "second")
    other = ple.Table.from_safetensors("t.safetensors")  # the same name, here
    program = torch.export.export(Gathers(table.handle), (torch.tensor(IDS),))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    for runnable in (program.module(), loaded.module()):
        assert torch.equal(runnable(torch.tensor(IDS)), values(1.0)[IDS])
    table.close()
    # The table closed, the program finds no other file's table in its place.
    with pytest.raises(ValueError, match=r"^ple table 't' \(handle t@\w+\) is closed"):
        loaded.module()(torch.tensor(IDS))
    other.close()


def test_the_error_of_a_file_that_changed_names_the_real_path(opened_here):
    module = DiskEmbedding.from_safetensors("t.safetensors")
    blob = pickle.dumps(module)
    save_file({"t": torch.zeros(ROWS // 2, COLS)}, "t.safetensors")
    os.chdir(opened_here / "second")
    with pytest.raises(ValueError) as error:
        pickle.loads(blob)
    assert str(error.value) == (
        f"ple table 't' cannot be opened again as it was pickled: "
        f"{(opened_here / 'first' / 't.safetensors').resolve()} now hold it with another layout "
        "(shards, offsets, format, scale); the files changed since")
