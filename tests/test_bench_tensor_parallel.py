"""tools/bench_tensor_parallel.py on the CPU: one process and two gloo ranks
over a tiny table, each rank serving its own rows, its figures recorded."""

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_tensor_parallel.py"


def test_bench_tensor_parallel_runs_two_ranks_on_the_cpu(tmp_path):
    run = subprocess.run(
        [sys.executable, str(TOOL), "--device", "cpu", "--table", str(tmp_path / "table"),
         "--mib", "0.25", "--calls", "2", "--timeout", "240", "--json", str(tmp_path / "run.json")],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    document = json.loads((tmp_path / "run.json").read_text())
    results = document["results"]
    num_rows = results["table_rows"]
    assert (results["backend"], results["world_size"]) == ("gloo", 2)
    assert results["one_process"]["served_rows"] == [0, num_rows]
    (first, middle), (middle_again, last) = (r["served_rows"] for r in results["ranks"])
    assert (first, middle, last) == (0, middle_again, num_rows) and 0 < middle < num_rows
    for figures in (results["one_process"], *results["ranks"]):
        # The CPU has no device tier: half the rows it serves are in its host tier.
        start, stop = figures["served_rows"]
        assert (figures["device_rows"], figures["host_rows"]) == (0, (stop - start) // 2)
        assert [case["rows"] for case in figures["cases"]] == [16, 32768]
        assert all(case["disk_us"] > 0 and case["tiers_us"] > 0 for case in figures["cases"])
    assert "rank 1 us" in document["report"]
