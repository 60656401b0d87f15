"""tools/bench_gather.py (ple-bench-gather, with tools/gather_arms.py,
table_layout.py, odirect.py, cgroup.py and report.py): the gather benchmark
runs end to end on a small table (--quick), reports every arm with its fields
and ratios between arms (no pass/fail goals), and every gathering arm returns
the same bytes; under a memory cgroup it runs each arm in a child, and without
the rights to make a cgroup it says so and exits non-zero.  The layout the
tool reads from ple.Table puts each row where the gather finds it."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ple
from ple_tools.make_table import PREFIX
from ple_tools.table_layout import PAGE, Layout

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "bench_gather.py"

FIELDS = ("arm", "state", "ms_median", "ms_min", "ms_max", "rows_per_s",
          "unique_pages_per_call", "read_bytes_per_call", "major_faults_per_call",
          "advised_pages_per_call", "evicted_before_copy_per_call", "sha256", "per_call")
GATHERING = ("none", "all", "distance:4096", "window:64", "window:4096", "direct",
             "direct-cache:256", "direct-depth:8")
DIRECT = ("direct", "direct-cache:256", "direct-depth:8")
QUICK_ARMS = ([("prime:32", "cold")] + [(a, "cold") for a in GATHERING] + [("ceiling:32", "cold")]
              + [(a, "warm") for a in GATHERING] + [("numpy", "warm")])


def run_tool(*args, timeout=300):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bench_table(tmp_path_factory):
    """Where the quick runs keep their table: written by the first, reused after."""
    return tmp_path_factory.mktemp("bench_gather") / "table"


@pytest.fixture(scope="module")
def quick(bench_table):
    out = bench_table.parent / "results.json"
    proc = run_tool("--quick", "--warm", "--table-gib", 0.0625, "--table", bench_table,
                    "--direct-depths", 8, "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())["results"]


def test_quick_reports_every_arm_with_its_fields(quick):
    proc, doc = quick
    arms = {(r["arm"], r["state"]): r for r in doc["arms"]}
    assert sorted(arms) == sorted(QUICK_ARMS)
    for key, r in arms.items():
        for field in FIELDS:
            assert field in r, (key, field)
        assert r["ms_min"] <= r["ms_median"] <= r["ms_max"], key
        assert len(r["per_call"]) == 4, key
        # warm, the row cache serves every row of direct-cache: no page is asked for
        assert r["unique_pages_per_call"] > 0 or key == ("direct-cache:256", "warm"), key
    assert doc["failed_arms"] == []
    assert "window:4096" in proc.stdout and "sha256" in proc.stdout


def test_quick_reports_ratios_and_no_goals(quick):
    proc, doc = quick
    assert "goals" not in doc
    assert "holds" not in proc.stdout and "FAILS" not in proc.stdout
    assert "ratios of median times" in proc.stdout
    ms = {(r["arm"], r["state"]): r["ms_median"] for r in doc["arms"]}
    ratios = doc["ratios"]
    assert ratios["reference"]["ceiling"] == "ceiling:32"
    by_arm = {(a["arm"], a["state"]): a for a in ratios["arms"]}
    assert sorted(by_arm) == sorted([(a, "cold") for a in GATHERING] + [(a, "warm") for a in GATHERING])
    for arm in GATHERING:
        cold, warm = by_arm[(arm, "cold")], by_arm[(arm, "warm")]
        assert cold["time_over_ceiling"] == pytest.approx(ms[(arm, "cold")] / ms[("ceiling:32", "cold")])
        assert warm["numpy_over_time"] == pytest.approx(ms[("numpy", "warm")] / ms[(arm, "warm")])
        assert cold["time_over_all"] is None and warm["time_over_ceiling"] is None  # no limit; warm
        if arm != "none":
            assert cold["none_over_time"] == pytest.approx(ms[("none", "cold")] / ms[(arm, "cold")])
        if arm in DIRECT:
            for state, ratio in (("cold", cold), ("warm", warm)):
                assert ratio["time_over_window"] == pytest.approx(
                    ms[(arm, state)] / ms[("window:4096", state)])
            cpu = {r["arm"]: r["cpu_us_per_page"] for r in doc["arms"] if r["state"] == "cold"}
            assert cold["cpu_page_over_ceiling"] == pytest.approx(cpu[arm] / cpu["ceiling:32"])
        else:
            assert cold["time_over_window"] is None and cold["cpu_page_over_ceiling"] is None
    assert by_arm[("none", "cold")]["none_over_time"] is None


def test_layout_puts_each_row_where_the_gather_finds_it(quick, bench_table):
    """Layout.of(table) (the shards' files and offsets, from ple.Table and
    the headers): the bytes at each row's offset are the row the gather returns."""
    with ple.Table.from_safetensors(bench_table, PREFIX) as table:
        layout = Layout.of(table)
        assert layout.paths == table.paths and layout.shard_rows == table.shard_rows
        assert layout.num_rows == table.num_rows and len(layout.shard_rows) == 8
        ids = torch.cat([torch.tensor([0, table.num_rows - 1]),
                         torch.randint(0, table.num_rows, (200,), generator=torch.Generator().manual_seed(0)),
                         torch.tensor(layout.shard_starts[1:-1], dtype=torch.int64)])
        gathered = table.gather_bytes(ids).numpy()
    _, files, offsets = layout.locate(ids.numpy())
    maps = [np.memmap(p, dtype=np.uint8, mode="r") for p in layout.paths]
    read = np.stack([maps[f][o:o + layout.row_bytes] for f, o in zip(files, offsets)])
    np.testing.assert_array_equal(read, gathered)
    pages = layout.pages(ids.numpy())
    assert len(pages) == len(set(((f << 40) | (o // PAGE)) for f, o in zip(files, offsets))
                              | set(((f << 40) | ((o + layout.row_bytes - 1) // PAGE))
                                    for f, o in zip(files, offsets)))


def test_quick_gathering_arms_return_the_same_bytes(quick):
    _, doc = quick
    digests = {(r["arm"], r["state"]): r["sha256"] for r in doc["arms"]}
    assert digests[("ceiling:32", "cold")] is None and digests[("prime:32", "cold")] is None
    gathered = {d for d in digests.values() if d is not None}
    assert len(gathered) == 1 and len(next(iter(gathered))) == 64
    assert doc["sha256_equal"]


def test_quick_cold_arms_read_from_disk(quick):
    _, doc = quick
    for r in doc["arms"]:
        if r["state"] == "cold":
            assert r["read_bytes_per_call"] > 0, r["arm"]
            # nothing read beyond the pages the calls ask for
            assert r["read_bytes_per_call"] <= 1.1 * r["unique_bytes_per_call"], r["arm"]
    none = next(r for r in doc["arms"] if (r["arm"], r["state"]) == ("none", "cold"))
    assert none["major_faults_per_call"] > 0
    window = next(r for r in doc["arms"] if (r["arm"], r["state"]) == ("window:4096", "cold"))
    assert window["advised_pages_per_call"] > 0
    for r in doc["arms"]:
        if r["arm"] in DIRECT and r["state"] == "cold":
            # no page cache: every call reads a block (512 B at least) of each of
            # its pages, and faults on none
            assert r["read_bytes_per_call"] >= r["unique_bytes_per_call"] / 4096 * 512, r["arm"]
            assert r["major_faults_per_call"] == 0 and r["direct_reads_per_call"] > 0
            assert r["io_backend"] in ("io_uring", "aio", "pread") and r["cpu_ms_per_call"] > 0


def test_memory_limit_without_cgroup_rights_says_so(tmp_path):
    command = [sys.executable, str(TOOL), "--quick", "--memory-limit", "300",
               "--table", str(tmp_path / "table")]
    if os.geteuid() == 0:
        # root can make cgroups: take the right away in a private mount
        # namespace where the cgroup filesystems are read-only
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip("running as root, and unshare -m is not available to take the rights away")
        remount = "for m in $(awk '$3 ~ /^cgroup2?$/ {print $2}' /proc/mounts); do " \
                  "mount -o remount,bind,ro \"$m\" || exit 99; done; exec \"$@\""
        command = ["unshare", "-m", "sh", "-c", remount, "sh", *command]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if proc.returncode == 99:
        pytest.skip(f"could not make the cgroup filesystems read-only: {proc.stderr.strip()}")
    assert proc.returncode != 0
    assert "--memory-limit needs a memory cgroup" in proc.stderr
    assert not (tmp_path / "table").exists()  # checked before anything is written


def test_pressure_run_in_a_memory_cgroup(bench_table, tmp_path):
    out = tmp_path / "results.json"
    proc = run_tool("--quick", "--table-gib", 0.0625, "--table", bench_table,
                    "--memory-limit", 300, "--ballast", 100, "--windows", 4096,
                    "--distance", 0, "--ceiling", "", "--no-prime", "--json", out)
    if proc.returncode != 0 and "needs a memory cgroup" in proc.stderr:
        pytest.skip(f"no memory cgroup here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())["results"]
    assert [r["arm"] for r in doc["arms"]] == ["none", "all", "window:4096", "direct",
                                               "direct-cache:256"]
    assert doc["sha256_equal"]
    for r in doc["arms"]:
        group = r["cgroup"]
        assert group["limit_bytes"] == 300 << 20 and group["ballast_bytes"] == 100 << 20
        assert group["usage_after_ballast"] >= 100 << 20  # the ballast is charged to the group
        assert r["read_bytes_per_call"] > 0
    assert _leftover_cgroups() == []  # the tool removed the groups it made
    ms = {r["arm"]: r["ms_median"] for r in doc["arms"]}
    ratios = {a["arm"]: a for a in doc["ratios"]["arms"]}
    assert doc["ratios"]["reference"]["pressure"] and "goals" not in doc
    assert ratios["window:4096"]["time_over_all"] == pytest.approx(ms["window:4096"] / ms["all"])
    assert ratios["all"]["time_over_all"] is None
    assert ratios["direct"]["time_over_window"] == pytest.approx(ms["direct"] / ms["window:4096"])


def _leftover_cgroups():
    """ple-bench-* groups where the tool makes them: the root of a cgroup v2
    hierarchy, or (v1) inside this process's memory cgroup."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return list(Path("/sys/fs/cgroup").glob("ple-bench-*"))
    with open("/proc/self/cgroup") as f:
        own = next((line.rstrip("\n").split(":", 2)[2] for line in f
                    if "memory" in line.split(":")[1].split(",")), "/")
    return list((Path("/sys/fs/cgroup/memory") / own.lstrip("/")).glob("ple-bench-*"))


def test_table_layout_options_and_rows_from_numpy(tmp_path):
    """--table-rows, --shards and --files lay the table out as asked (the
    reference table's form, at a small size), and the bytes the arms gather
    are the files' own, read with NumPy at the layout's offsets."""
    table, out = tmp_path / "table", tmp_path / "results.json"
    proc = run_tool("--quick", "--table", table, "--table-rows", 50_000, "--shards", 6,
                    "--files", 4, "--calls", 2, "--rows", 500, "--windows", 4096, "--distance", 0,
                    "--direct-cache", 0, "--ceiling", "", "--no-prime", "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())["results"]
    assert doc["table"]["num_rows"] == 50_000 and len(doc["table"]["files"]) == 4
    assert doc["table"]["shard_rows"] == [8334] * 5 + [50_000 - 5 * 8334]
    assert [r["arm"] for r in doc["arms"]] == ["none", "all", "window:4096", "direct"]
    assert doc["sha256_equal"]
    from ple_tools.demo import make_requests

    layout = Layout.open(table, PREFIX)
    maps = [np.memmap(p, dtype=np.uint8, mode="r") for p in layout.paths]
    digest = hashlib.sha256()
    for ids in make_requests(layout.num_rows, 2, 500, 0):
        _, files, offsets = layout.locate(ids.numpy())
        digest.update(np.stack([maps[f][o:o + 160] for f, o in zip(files, offsets)]).data)
    assert doc["arms"][0]["sha256"] == digest.hexdigest()


def test_parallel_writers_write_the_same_files(tmp_path):
    """make_table's writer processes write the bytes one writer writes."""
    from ple_tools.make_table import write_table

    layout = dict(rows=20_000, row_bytes=160, shards=6, files=3, seed=5)
    one = write_table(tmp_path / "one", writers=1, **layout)
    two = write_table(tmp_path / "two", writers=2, **layout)
    assert [p.name for p in one] == [p.name for p in two] and len(one) == 3
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two))
