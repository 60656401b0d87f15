"""tools/bench_layers.py on a small table: every mode gives the same values,
and every prefetched step is a prefetch hit; a --table directory holding
files ple did not write is refused, and left as it was."""

import subprocess
import sys
from pathlib import Path

from helpers import directory_bytes, foreign_files_message, save_a_model

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


def test_bench_layers_refuses_a_directory_holding_a_model(tmp_path):
    save_a_model(tmp_path)
    before = directory_bytes(tmp_path)
    run = subprocess.run(
        [sys.executable, str(TOOL), "--table", str(tmp_path), "--table-gib", "0.01"],
        capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stdout) == (2, ""), run.stderr
    message = foreign_files_message(tmp_path, ["model.safetensors", "notes.txt"])
    assert run.stderr == f"error: {message}\n"
    assert directory_bytes(tmp_path) == before
