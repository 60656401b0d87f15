"""ple.COUNTERS is the one list of what Table.stats() returns: the native
gather's counters (kernels/counters.h, exported as native.COUNTERS) and the
tiers' two, each with a line on what it counts."""

from __future__ import annotations

import pytest
import torch

import ple
from helpers import write_arange_table
from ple.counters import TIER_COUNTERS
from ple.kernels.native import native


@pytest.fixture
def table(tmp_path):
    with ple.Table.from_safetensors(write_arange_table(tmp_path / "t.safetensors", 1000, 4)) as table:
        yield table


def test_every_counter_has_a_meaning():
    assert ple.Table.COUNTERS is ple.COUNTERS
    assert len(ple.COUNTERS) == 20
    for name, meaning in ple.COUNTERS.items():
        assert name.isidentifier() and name.islower()
        assert isinstance(meaning, str) and len(meaning) > 10 and "\n" not in meaning


def test_the_list_is_the_native_counters_and_the_tier_counters(table):
    names = [name for name, _ in native.COUNTERS]
    assert len(set(names)) == len(names)
    assert sorted(native.stats(table._native_handle())) == sorted(names)  # the native side returns its list
    assert list(ple.COUNTERS) == names + list(TIER_COUNTERS)
    assert list(TIER_COUNTERS) == ["device_tier_hits", "host_tier_hits"]


def test_stats_returns_exactly_the_counters(table):
    assert list(table.stats()) == list(ple.COUNTERS)
    table.config = ple.GatherConfig(row_cache_mib=1)
    ids = torch.arange(0, 1000, 7)
    table.prefetch(ids)
    table.gather_bytes(ids)
    table.place(host_rows=100, first_row=50)
    table.gather_bytes(ids)
    stats = table.stats()
    assert list(stats) == list(ple.COUNTERS)
    assert all(isinstance(value, int) and value >= 0 for value in stats.values())
    assert stats["prefetch_hits"] == 1 and stats["host_tier_hits"] == 14 and stats["row_cache_hits"] > 0
    assert stats["bytes_copied"] == stats["rows"] * table.row_bytes
    table.reset_stats()
    assert table.stats() == dict.fromkeys(ple.COUNTERS, 0)
