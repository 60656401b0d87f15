"""tools/tiny_model.py runs on the CPU, eager and compiled, with equal outputs."""

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "tiny_model.py"


@pytest.mark.slow
def test_tiny_model_runs_on_cpu(tmp_path):
    """Compiles the model once (seconds on 2 cores)."""
    run = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "eager: 4 steps" in run.stdout
    assert "compiled: 4 steps, output (16, 256), equal to eager" in run.stdout
    assert "prefetch_hits 4, prefetch_misses 0" in run.stdout
