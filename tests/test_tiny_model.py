"""tools/tiny_model.py runs on the CPU, eager and compiled, with equal
outputs; --out keeps its tables in a directory that its marker lists them
in, as the other tools keep theirs (ple_tools.written)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import directory_bytes, foreign_files_message, save_a_model

TOOL = Path(__file__).resolve().parents[1] / "tools" / "tiny_model.py"
WRITTEN = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tiny.gguf"]


@pytest.mark.slow
def test_tiny_model_runs_on_cpu(tmp_path):
    """Compiles the model once (seconds on 2 cores)."""
    run = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "eager: 4 steps" in run.stdout
    assert "compiled: 4 steps, output (16, 256), equal to eager" in run.stdout
    assert "prefetch_hits 4, prefetch_misses 0" in run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [*WRITTEN[:2], "ple_tiny_model.json",
                                                          WRITTEN[2]]


def test_the_tables_are_listed_in_out_and_written_again_there(tmp_path):
    from ple_tools import tiny

    for _ in range(2):  # the second time over the first one's files
        files, gguf = tiny.write_tables(tmp_path)
        assert [f.name for f in files] + [gguf.name] == WRITTEN
        assert json.loads((tmp_path / "ple_tiny_model.json").read_text()) == {
            "written_by": "ple-tiny-model", "what": "the tiny model's tables", "complete": True,
            "files": WRITTEN}
        assert sorted(p.name for p in tmp_path.iterdir()) == [*WRITTEN[:2], "ple_tiny_model.json",
                                                              WRITTEN[2]]


def test_out_holding_a_saved_model_is_refused_before_anything_is_written(tmp_path):
    save_a_model(tmp_path)
    before = directory_bytes(tmp_path)
    run = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stdout) == (2, "")
    message = foreign_files_message(tmp_path, ["model.safetensors", "notes.txt"],
                                    "ple_tiny_model.json")
    assert run.stderr == f"error: {message}\n"
    assert directory_bytes(tmp_path) == before
