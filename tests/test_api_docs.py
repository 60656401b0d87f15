"""The public API documents itself: help(ple.Table) lists and explains every
attribute a table has, and GatherConfig's docstring every field."""

from __future__ import annotations

import dataclasses
import pydoc
import re

import torch
from safetensors.torch import save_file

import ple

TABLE_ATTRIBUTES = ["name", "num_rows", "cols", "format", "row_format", "row_bytes", "scale",
                    "shard_rows", "paths", "handle", "dtype", "config", "io_backend", "tiers",
                    "resident_range"]


def documented(docstring: str) -> dict[str, str]:
    """The entries of a docstring's "Attributes:" section, by name (an entry
    ``a, b: text`` documents both)."""
    section = docstring.split("Attributes:", 1)[1]
    entries = {}
    for names, text in re.findall(r"^ {4,8}(\w+(?:, \w+)*): (.+)$", section, re.M):
        for name in names.split(", "):
            entries[name] = text
    return entries


def test_help_of_table_explains_every_attribute(tmp_path):
    text = pydoc.render_doc(ple.Table, renderer=pydoc.plaintext)
    entries = documented(ple.Table.__doc__)
    for name in TABLE_ATTRIBUTES:
        assert name in entries, name
        assert len(entries[name]) > 10, name
        assert f"{name}: " in text
    f = tmp_path / "t.safetensors"
    save_file({"t": torch.zeros(4, 2)}, str(f))
    with ple.Table.from_safetensors(f) as table:
        public = {name for name in vars(table) if not name.startswith("_")}
    properties = {name for name, value in vars(ple.Table).items() if isinstance(value, property)}
    assert public | properties <= set(entries), (public | properties) - set(entries)
    assert all(vars(ple.Table)[name].__doc__ for name in properties)


def test_gather_config_documents_every_field():
    entries = documented(ple.GatherConfig.__doc__)
    assert [f.name for f in dataclasses.fields(ple.GatherConfig)] == [
        name for name in entries if name in {f.name for f in dataclasses.fields(ple.GatherConfig)}]
    for policy in ple.POLICIES:
        assert f'"{policy}"' in ple.GatherConfig.__doc__
