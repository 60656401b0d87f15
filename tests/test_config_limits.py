"""GatherConfig's ranges: values the native side cannot take (they became a
pybind TypeError when a table took the config) and thread counts that would
start thousands of threads for the life of the process are a ValueError at
construction, naming the field, the value and the range.  README
"Reliability"."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

import ple
from ple.config import MAX_PREFETCH_WINDOW_KIB, MAX_ROW_CACHE_MIB, MAX_THREADS, GatherConfig


def test_the_limits():
    # The native side relies on this name and value.
    assert MAX_THREADS == 256
    assert MAX_PREFETCH_WINDOW_KIB == 2**40
    assert MAX_ROW_CACHE_MIB == 2**40
    # In bytes, what the native side counts in: within int64, with room.
    assert MAX_PREFETCH_WINDOW_KIB * 1024 < 2**63 and MAX_ROW_CACHE_MIB << 20 < 2**63


@pytest.mark.parametrize("field, value, least, most", [
    ("threads", 2**31, 1, MAX_THREADS),
    ("threads", 10_000, 1, MAX_THREADS),
    ("threads", MAX_THREADS + 1, 1, MAX_THREADS),
    ("threads", 0, 1, MAX_THREADS),
    ("prefetch_window_kib", 2**60, 0, MAX_PREFETCH_WINDOW_KIB),
    ("prefetch_window_kib", MAX_PREFETCH_WINDOW_KIB + 1, 0, MAX_PREFETCH_WINDOW_KIB),
    ("prefetch_window_kib", -1, 0, MAX_PREFETCH_WINDOW_KIB),
    ("row_cache_mib", 2**45, 0, MAX_ROW_CACHE_MIB),
    ("row_cache_mib", MAX_ROW_CACHE_MIB + 1, 0, MAX_ROW_CACHE_MIB),
    ("row_cache_mib", -1, 0, MAX_ROW_CACHE_MIB),
    ("io_queue_depth", 0, 1, 1024),
    ("io_queue_depth", 1025, 1, 1024),
    ("io_block_bytes", -1, 0, 65536),
    ("io_block_bytes", 131072, 0, 65536),
])
def test_out_of_range_is_a_value_error_naming_field_value_and_range(field, value, least, most):
    bound = f"at least {least}" if value < least else f"at most {most}"
    message = f"{field} must be {bound}, got {value} (the range is [{least}, {most}])"
    with pytest.raises(ValueError, match=re.escape(message)):
        GatherConfig(**{field: value})


@pytest.mark.parametrize("value", [3, 511, 4097, 65535])
def test_a_block_that_is_not_a_power_of_two_is_a_value_error(value):
    with pytest.raises(ValueError, match=f"io_block_bytes must be 0 or a power of two, got {value}$"):
        GatherConfig(io_block_bytes=value)


def test_the_largest_values_are_taken_by_a_table(tmp_path):
    f = tmp_path / "t.safetensors"
    values = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    save_file({"t": values}, str(f))
    with ple.Table.from_safetensors(f) as table:
        for policy in ple.POLICIES:
            # A request this small runs on one thread whatever `threads` says.
            table.config = GatherConfig(policy, MAX_PREFETCH_WINDOW_KIB, MAX_THREADS)
            assert torch.equal(torch.ops.ple.disk_gather(torch.tensor([9, 0, 3]), table.handle),
                               values[[9, 0, 3]])
        GatherConfig(row_cache_mib=MAX_ROW_CACHE_MIB)  # in range; the table's memory may not be


# One definition --------------------------------------------------------------------------

def test_fields_defaults_units_and_ranges_are_the_native_parts():
    """GatherConfig's fields, defaults and ranges and the policies come from
    kernels/gather_config.h (native.CONFIG_FIELDS); nothing repeats them."""
    import dataclasses
    import os

    from ple.config import FIELDS, IO_MODES, POLICIES, RANGES
    from ple.kernels.native import native

    by_name = {entry["name"]: entry for entry in native.CONFIG_FIELDS}
    assert [f.name for f in dataclasses.fields(GatherConfig)] == list(by_name) == list(FIELDS)
    assert POLICIES == ple.POLICIES == native.POLICIES == by_name["policy"]["choices"]
    assert POLICIES == ("window", "distance", "all", "none")
    default = GatherConfig()
    assert default.policy == by_name["policy"]["default"] == POLICIES[0]
    assert default.prefetch_window_kib == by_name["prefetch_window_kib"]["default"] == 4096
    assert default.row_cache_mib == by_name["row_cache_mib"]["default"] == 0
    assert default.threads == min(by_name["threads"]["default"], os.cpu_count() or 1)
    assert by_name["threads"]["default"] == 16
    assert default.io == by_name["io"]["default"] == IO_MODES[0] == "mmap"
    assert IO_MODES == native.IO_MODES == by_name["io"]["choices"] == ("mmap", "direct")
    assert default.io_queue_depth == by_name["io_queue_depth"]["default"] == 64
    assert RANGES == {name: (e["least"], e["most"]) for name, e in by_name.items()
                      if name not in ("policy", "io")}
    assert RANGES["io_queue_depth"] == (1, 1024)
    assert MAX_THREADS == native.MAX_THREADS == by_name["threads"]["most"]
    assert (by_name["prefetch_window_kib"]["unit"], by_name["prefetch_window_kib"]["unit_bytes"]) == ("KiB", 1024)
    assert (by_name["row_cache_mib"]["unit"], by_name["row_cache_mib"]["unit_bytes"]) == ("MiB", 1 << 20)
    assert by_name["threads"]["unit_bytes"] == 0
    assert by_name["io_queue_depth"]["unit_bytes"] == 0
    assert default.io_block_bytes == by_name["io_block_bytes"]["default"] == 0
    assert RANGES["io_block_bytes"] == (0, 65536)
    assert (by_name["io_block_bytes"]["unit"], by_name["io_block_bytes"]["unit_bytes"]) == ("bytes", 1)
    assert [name for name, e in by_name.items() if e.get("power_of_two")] == ["io_block_bytes"]
    config = GatherConfig("distance", 7, 3, 5, 9, 4096, "direct")
    assert config._native_args() == ("distance", 7 << 10, 3, 5 << 20, 9, 4096, "direct")


def test_the_native_side_refuses_what_gather_config_refuses(tmp_path):
    """native.configure (bytes) checks the same ranges: the largest values
    GatherConfig allows are taken, one byte more is a ValueError."""
    from ple.kernels.native import native

    f = tmp_path / "t.safetensors"
    save_file({"t": torch.zeros(10, 4)}, str(f))
    with ple.Table.from_safetensors(f) as table:
        for policy in ple.POLICIES:
            native.configure(table._native_handle(), *GatherConfig(policy, MAX_PREFETCH_WINDOW_KIB,
                                                         MAX_THREADS)._native_args())
        with pytest.raises(ValueError, match="unknown prefetch policy 'sometimes'"):
            native.configure(table._native_handle(), "sometimes", 0, 1, 0, 64, 0, "mmap")
        with pytest.raises(ValueError, match=rf"prefetch_window_kib must be at most {MAX_PREFETCH_WINDOW_KIB} KiB, "
                           rf"got {(MAX_PREFETCH_WINDOW_KIB << 10) + 1} bytes$"):
            native.configure(table._native_handle(), "window", (MAX_PREFETCH_WINDOW_KIB << 10) + 1, 1, 0, 64,
                             0, "mmap")
        with pytest.raises(ValueError, match=rf"row_cache_mib must be at most {MAX_ROW_CACHE_MIB} MiB, "
                           rf"got {(MAX_ROW_CACHE_MIB << 20) + 1} bytes$"):
            native.configure(table._native_handle(), "window", 0, 1, (MAX_ROW_CACHE_MIB << 20) + 1, 64, 0, "mmap")
        with pytest.raises(ValueError, match="threads must be at least 1"):
            native.configure(table._native_handle(), "window", 0, 0, 0, 64, 0, "mmap")
        with pytest.raises(ValueError, match="io_queue_depth must be at most 1024, got 1025"):
            native.configure(table._native_handle(), "window", 0, 1, 0, 1025, 0, "direct")
        with pytest.raises(ValueError, match="io_block_bytes must be 0 or a power of two, got 768"):
            native.configure(table._native_handle(), "window", 0, 1, 0, 64, 768, "direct")
        with pytest.raises(ValueError, match=r"unknown io mode 'dax' \(expected one of mmap, direct\)"):
            native.configure(table._native_handle(), "window", 0, 1, 0, 64, 0, "dax")
        table.config = GatherConfig()
        assert torch.equal(torch.ops.ple.disk_gather(torch.tensor([3]), table.handle), torch.zeros(1, 4))


def test_the_config_read_back_is_the_one_in_force_after_racing_assignments(tmp_path):
    """300 races of two assignments of different configs, beside 16
    threads that gather (each gather on up to 16 threads: more native
    threads than CPUs): after each race, `table.config` is the config in
    force, as the row cache shows (it counts hits and misses only while one
    is configured).  The gathers pause while it is looked at: a gather
    counts by the config it started with."""
    import random
    import threading

    f = tmp_path / "t.safetensors"
    save_file({"t": torch.arange(20_000 * 16, dtype=torch.float32).reshape(20_000, 16)}, str(f))
    cached = [GatherConfig("window", 1024, threads, row_cache_mib=1) for threads in (1, 4, 16)]
    uncached = [GatherConfig("none", 0, threads) for threads in (2, 8, 16)]
    ids = torch.arange(0, 20_000, 97)
    rounds, gatherers = 300, 16
    with ple.Table.from_safetensors(f) as table:
        gate = threading.Condition()
        state = {"paused": False, "stopped": False, "gathering": 0}
        errors = []

        def gather(seed):
            rng = torch.Generator().manual_seed(seed)
            try:
                while True:
                    with gate:
                        gate.wait_for(lambda: not state["paused"] or state["stopped"])
                        if state["stopped"]:
                            return
                        state["gathering"] += 1
                    try:
                        table.gather_bytes(torch.randint(0, 20_000, (4096,), generator=rng))
                    finally:
                        with gate:
                            state["gathering"] -= 1
                            gate.notify_all()
            except BaseException as error:  # noqa: BLE001 - reported by the main thread
                errors.append(error)

        start, done = threading.Barrier(3), threading.Barrier(3)
        picks: list[GatherConfig] = [cached[0], uncached[0]]

        def assign(which):
            for _ in range(rounds):
                start.wait()
                table.config = picks[which]
                done.wait()

        threads = [threading.Thread(target=gather, args=(k,), daemon=True)
                   for k in range(gatherers)]
        threads += [threading.Thread(target=assign, args=(k,), daemon=True) for k in (0, 1)]
        for thread in threads:
            thread.start()
        rng = random.Random(0)
        disagreements = []
        try:
            for race in range(rounds):
                picks[:] = rng.sample([rng.choice(cached), rng.choice(uncached)], 2)
                with gate:
                    state["paused"] = False
                    gate.notify_all()
                start.wait(timeout=60)
                done.wait(timeout=60)
                with gate:
                    state["paused"] = True
                    assert gate.wait_for(lambda: state["gathering"] == 0, timeout=60)
                read = table.config
                before = table.stats()
                table.gather_bytes(ids)
                after = table.stats()
                in_force = any(after[k] > before[k] for k in ("row_cache_hits", "row_cache_misses"))
                if read not in picks or (read.row_cache_mib > 0) != in_force:
                    disagreements.append((race, read, in_force))
        finally:
            with gate:
                state["stopped"] = True
                gate.notify_all()
            start.abort()
            done.abort()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors[:3]
        assert disagreements == []
