"""The README's first example runs as written and gives what it says; the
counters table of docs/counters.md is ple.COUNTERS."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def first_table_example() -> str:
    section = README.read_text().split("\n## A first table\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_the_first_table_example_runs(tmp_path):
    done = subprocess.run([sys.executable, "-c", first_table_example()], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first.startswith("ple.Table('emb', 100000 rows x 64 fp8_e4m3fn, 2 shard(s), scale=0.5")
    assert second == "4 3"


def test_the_counters_table_is_ple_counters():
    import ple

    section = (README.parent / "docs" / "counters.md").read_text()
    listed = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", section, re.M))
    assert listed == dict(ple.COUNTERS)
