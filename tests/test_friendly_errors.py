"""The common mistakes get errors that say what to do: a table where the
operators take a handle, a GGUF file opened as safetensors, one shard of a
family opened by name (it keeps the family's scale), a path that is not
UTF-8; ple.FORMATS lists every format and ple.__version__ is the package's."""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple
from helpers import write_arange_table, write_gguf


@pytest.fixture
def table(tmp_path):
    values = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    save_file({"w": values}, str(tmp_path / "w.safetensors"))
    with ple.Table.from_safetensors(tmp_path) as opened:
        yield opened, values


def test_gather_takes_the_table(table):
    opened, values = table
    assert torch.equal(ple.gather(opened, [4, 1]), values[[4, 1]])
    assert torch.equal(ple.gather(opened, torch.tensor([[0], [5]]), torch.bfloat16),
                       values[torch.tensor([[0], [5]])].to(torch.bfloat16))


def test_gather_names_what_is_not_a_table(table):
    opened, _ = table
    with pytest.raises(TypeError, match=r"^ple.gather takes a ple.Table, not str \(the operators "
                                        r"take table.handle\)$"):
        ple.gather(opened.handle, [1])


def test_a_gguf_file_opened_as_safetensors_says_so(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, {"t": (np.zeros((4, 32), dtype=np.float32), gguf.GGMLQuantizationType.F32)})
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: a GGUF file, not a safetensors "
                                         r"file: open it with ple.Table.from_gguf\(path, tensor\)$"):
        ple.Table.from_safetensors(path)


def test_one_shard_of_a_family_keeps_the_familys_scale(tmp_path):
    raw = torch.randint(0, 120, (2, 5, 8), dtype=torch.uint8)  # finite FP8 patterns
    save_file({f"x.shard_{i}.weight": raw[i].view(torch.float8_e4m3fn) for i in range(2)}
              | {"x.weight_scale": torch.tensor(0.5)}, str(tmp_path / "x.safetensors"))
    with ple.Table.from_safetensors(tmp_path, "x.shard_1.weight") as shard:
        assert shard.scale == 0.5
        expected = raw[1].view(torch.float8_e4m3fn).to(torch.float32) * 0.5
        assert torch.equal(ple.gather(shard, torch.arange(5)), expected)


def test_formats_lists_every_format():
    assert {"f32", "f16", "bf16", "fp8_e4m3fn", "u8", "i8", "q8_0", "q4_0", "iq4_nl", "q4_k",
            "q6_k"} == set(ple.FORMATS)


def test_version_is_the_packages():
    assert ple.__version__ == importlib.metadata.version("ple")


def test_a_path_that_is_not_utf8_opens_and_its_errors_name_it(tmp_path):
    # Python hands such a name over as a str with surrogate escapes (os.fsdecode).
    directory = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"rows\xff")))
    directory.mkdir()
    path = write_arange_table(directory / "t\udcfe.safetensors", rows=4096, cols=16)
    with ple.Table.from_safetensors(directory) as table:
        assert table.paths == [path]
        assert torch.equal(ple.gather(table, [3]), torch.arange(48, 64, dtype=torch.float32)[None])
        os.truncate(path, 4096)
        # The native error names the file as Python would, not UnicodeDecodeError.
        with pytest.raises(OSError, match=re.escape(str(path))):
            ple.gather(table, [4095])
