"""tools/bench_layers.py on a small table: every mode gives the same values,
and every prefetched step is a prefetch hit."""

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_layers.py"


def test_bench_layers_runs_on_a_small_table(tmp_path):
    run = subprocess.run(
        [sys.executable, str(TOOL), "--table", str(tmp_path / "table"), "--table-gib", "0.01",
         "--tokens", "8", "--steps", "3", "--compute-ms", "0"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every mode returned the same values" in run.stderr
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines()[1:]}
    assert set(rows) == {"cold", "prefetch", "warm"}
    assert rows["prefetch"][5] == "3"  # prefetch hits
    assert rows["cold"][5] == rows["warm"][5] == "0"
