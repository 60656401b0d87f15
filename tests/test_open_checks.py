"""What opening a table refuses that it used to take: files that are not
regular files (a FIFO blocked the open forever), tensors whose bytes overlap
and keys written twice (the safetensors package refuses both), and shard
indices that are not written canonically (``x.shard_01`` was taken as shard 1).
README "Reliability"."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ple
from helpers import REPO, write_gguf

HANG_SECONDS = 60


def write_raw(path: Path, header: dict | bytes, data: bytes) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def raises_naming(exc, *names):
    pattern = "".join(f"(?=.*{re.escape(str(n))})" for n in names)
    return pytest.raises(exc, match=re.compile(pattern, re.DOTALL))


def u8(shape, begin):
    size = 1
    for d in shape:
        size *= d
    return {"dtype": "U8", "shape": list(shape), "data_offsets": [begin, begin + size]}


# ------------------------------------------------------------------ not regular files

# Run in a child: before the check, opening a FIFO for reading blocked until
# a writer came, that is forever; the timeout turns that into a failure.
FIFO_SCRIPT = r"""
import json, sys
import ple
results = {}
for case, call, arg in json.loads(sys.argv[1]):
    try:
        if call == "gguf":
            ple.Table.from_gguf(arg, "t")
        else:
            ple.Table.from_safetensors(arg)
        results[case] = "opened"
    except Exception as error:
        results[case] = [type(error).__name__, str(error)]
print(json.dumps(results))
"""


def test_fifos_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "t.safetensors"
    os.mkfifo(fifo)
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    save_file({"a": torch.zeros(2, 4)}, str(directory / "a.safetensors"))
    os.mkfifo(directory / "b.safetensors")
    linked = tmp_path / "linked"
    linked.mkdir()
    save_file({"a": torch.zeros(2, 4)}, str(linked / "a.safetensors"))
    (linked / "c.safetensors").symlink_to(fifo)
    gguf_fifo = tmp_path / "t.gguf"
    os.mkfifo(gguf_fifo)
    cases = [("file", "safetensors", str(fifo)), ("in a directory", "safetensors", str(directory)),
             ("symlink in a directory", "safetensors", str(linked)),
             ("gguf", "gguf", str(gguf_fifo))]
    named = {"file": fifo, "in a directory": directory / "b.safetensors",
             "symlink in a directory": linked / "c.safetensors", "gguf": gguf_fifo}
    try:
        proc = subprocess.run([sys.executable, "-c", FIFO_SCRIPT, json.dumps(cases)], cwd=REPO,
                              capture_output=True, text=True, timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"opening a FIFO as a table did not return in {HANG_SECONDS} s: it blocked")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, path in named.items():
        kind, message = results[case]
        assert kind == "ValueError", (case, results[case])
        assert str(path) in message and "not a regular file (a FIFO)" in message, (case, message)


def test_other_kinds_of_file_are_refused(tmp_path):
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    save_file({"a": torch.zeros(2, 4)}, str(directory / "a.safetensors"))
    (directory / "sub.safetensors").mkdir()
    with raises_naming(ValueError, directory / "sub.safetensors", "not a regular file (a directory)"):
        ple.Table.from_safetensors(directory)
    # /dev/zero reads zeros without end: once a header length of 0, now refused for what it is.
    with raises_naming(ValueError, "/dev/zero", "not a regular file (a character device)"):
        ple.Table.from_safetensors("/dev/zero")
    with raises_naming(ValueError, "/dev/zero", "not a regular file (a character device)"):
        ple.Table.from_gguf("/dev/zero", "t")
    with raises_naming(ValueError, tmp_path, "not a regular file (a directory)"):
        ple.Table.from_gguf(tmp_path, "t")
    with pytest.raises(FileNotFoundError):
        ple.Table.from_gguf(tmp_path / "missing.gguf", "t")


def test_regular_files_and_symlinks_to_them_still_open(tmp_path):
    target = tmp_path / "real.safetensors"
    save_file({"t": torch.arange(8, dtype=torch.float32).reshape(2, 4)}, str(target))
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    with ple.Table.from_safetensors(link) as table:
        assert table.num_rows == 2
    gguf_path = tmp_path / "t.gguf"
    import gguf
    import numpy as np
    write_gguf(gguf_path, {"t": (np.ones((3, 32), dtype=np.float32), gguf.GGMLQuantizationType.F32)})
    with ple.Table.from_gguf(gguf_path, "t") as table:
        assert table.num_rows == 3


# ------------------------------------------------------------------ shared bytes, keys twice


OVERLAPS = {
    # name: (header, the tensors the error must name, the table to ask for)
    "two tensors share bytes": ({"a": u8((4, 4), 0), "b": u8((4, 4), 8)}, ("'a'", "'b'"), "a"),
    "two shards on the same bytes": (
        {"x.shard_0.weight": u8((2, 8), 0), "x.shard_1.weight": u8((2, 8), 0)},
        ("'x.shard_0.weight'", "'x.shard_1.weight'"), "x"),
    "a scale inside the rows": (
        {"t": u8((4, 4), 0), "t_scale": {"dtype": "F32", "shape": [], "data_offsets": [4, 8]}},
        ("'t'", "'t_scale'"), "t"),
    "a tensor inside another": ({"a": u8((8, 4), 0), "b": u8((2,), 10)}, ("'a'", "'b'"), "a"),
}


@pytest.mark.parametrize("case", list(OVERLAPS))
def test_tensors_that_share_bytes_are_refused(tmp_path, case):
    header, names, tensor = OVERLAPS[case]
    f = write_raw(tmp_path / "t.safetensors", header, bytes(range(64)))
    with pytest.raises(Exception):  # the premise: the safetensors package refuses the file
        with safe_open(str(f), "pt") as opened:
            [opened.get_tensor(k) for k in opened.keys()]
    with raises_naming(ValueError, f, *names, "share bytes"):
        ple.Table.from_safetensors(f, tensor)
    with raises_naming(ValueError, f, *names, "share bytes"):
        ple.Table.from_safetensors(f)


def test_tensors_that_touch_or_hold_no_bytes_are_fine(tmp_path):
    # Adjacent spans, and a tensor of no bytes at any offset, share no byte.
    header = {"a": u8((2, 4), 0), "b": u8((2, 4), 8), "empty": u8((0, 4), 4)}
    f = write_raw(tmp_path / "t.safetensors", header, bytes(range(16)))
    with ple.Table.from_safetensors(f, "b") as table:
        assert table.gather_bytes(torch.tensor([0, 1])).flatten().tolist() == list(range(8, 16))


def test_a_tensor_named_twice_is_refused(tmp_path):
    # json.loads keeps the last of two keys: the first entry vanished.
    text = (b'{"t": {"dtype": "U8", "shape": [2, 4], "data_offsets": [0, 8]}, '
            b'"t": {"dtype": "U8", "shape": [2, 4], "data_offsets": [8, 16]}}')
    f = write_raw(tmp_path / "t.safetensors", text, bytes(16))
    with raises_naming(ValueError, f, "tensor 't' appears twice"):
        ple.Table.from_safetensors(f)


def test_a_field_written_twice_is_refused(tmp_path):
    text = b'{"t": {"dtype": "F32", "dtype": "U8", "shape": [2, 4], "data_offsets": [0, 8]}}'
    f = write_raw(tmp_path / "t.safetensors", text, bytes(8))
    with pytest.raises(Exception, match="duplicate field"):
        with safe_open(str(f), "pt"):
            pass
    with raises_naming(ValueError, f, "'t'", "key 'dtype' appears twice"):
        ple.Table.from_safetensors(f)


def test_metadata_keys_written_twice_are_left_alone(tmp_path):
    # The safetensors package loads these (metadata is a map of strings to it);
    # ple ignores metadata, so it opens them too.
    text = (b'{"__metadata__": {"format": "pt", "format": "np"}, '
            b'"t": {"dtype": "U8", "shape": [2, 4], "data_offsets": [0, 8]}}')
    f = write_raw(tmp_path / "t.safetensors", text, bytes(8))
    with ple.Table.from_safetensors(f) as table:
        assert table.num_rows == 2


# ------------------------------------------------------------------ shard indices


def test_shard_index_with_leading_zeros_is_refused(tmp_path):
    # Shards "x.shard_0" and "x.shard_01" were taken as shards 0 and 1.
    f = tmp_path / "t.safetensors"
    save_file({"x.shard_0.weight": torch.zeros(2, 4), "x.shard_01.weight": torch.ones(2, 4)}, str(f))
    for tensor in ("x", None):
        with raises_naming(ValueError, f, "'x.shard_01.weight'", "leading zeros",
                           "'x.shard_1.weight'"):
            ple.Table.from_safetensors(f, tensor)
    g = tmp_path / "only.safetensors"
    save_file({"x.shard_00.weight": torch.zeros(2, 4)}, str(g))
    with raises_naming(ValueError, g, "'x.shard_00.weight'", "leading zeros", "'x.shard_0.weight'"):
        ple.Table.from_safetensors(g, "x")


def test_shard_indices_are_ascii_digits(tmp_path):
    # "\u0661" is ARABIC-INDIC DIGIT ONE: \d matched it and int() reads it as
    # 1, so this was shard 1 of "x".  Now it is a tensor of its own.
    odd = "x.shard_\u0661.weight"
    f = tmp_path / "t.safetensors"
    save_file({"x.shard_0.weight": torch.zeros(2, 4), odd: torch.ones(3, 4)}, str(f))
    with ple.Table.from_safetensors(f, "x") as table:
        assert table.shard_rows == [2]
    with ple.Table.from_safetensors(f, odd) as table:
        assert table.num_rows == 3


def test_canonical_shard_indices_still_open(tmp_path):
    f = tmp_path / "t.safetensors"
    save_file({f"x.shard_{i}.weight": torch.full((2, 4), float(i)) for i in range(12)}, str(f))
    with ple.Table.from_safetensors(f) as table:
        assert table.shard_rows == [2] * 12
        rows = torch.ops.ple.disk_gather(torch.tensor([0, 21, 23]), table.handle)
        assert rows[:, 0].tolist() == [0.0, 10.0, 11.0]
