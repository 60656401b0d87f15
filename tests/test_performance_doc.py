"""docs/performance.md shows the benchmark documents of docs/figures/ as
tools/figures.py renders them (the page is kept current from the tools'
--json output), and a tool's --json document holds what the run printed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ple_tools import figures


def test_every_block_of_the_page_is_its_document():
    page = figures.PAGE.read_text()
    names = [m["name"] for m in figures.BLOCK.finditer(page)]
    assert names, "docs/performance.md shows no benchmark document"
    assert sorted(set(names)) == sorted(p.name for p in figures.FIGURES.glob("*.json")), \
        "every document in docs/figures/ is shown once, and only those"
    _, stale = figures.updated(page, figures.FIGURES)
    assert stale == [], f"stale blocks (run python tools/figures.py): {stale}"


def test_run_recorded_keeps_the_report_and_results(tmp_path, capsys):
    path = tmp_path / "run.json"

    def run():
        print("arm  ms/call\nnone  1.5")
        return 3, [{"arm": "none", "ms": 1.5}]

    args = argparse.Namespace(mib=4, table=Path("data/t"), json=path)
    assert figures.run_recorded(args, "demo", ["--mib", "4", "--json", str(path)], run) == 3
    assert capsys.readouterr().out == "arm  ms/call\nnone  1.5\n"  # still printed
    document = json.loads(path.read_text())
    assert document["command"] == "python tools/demo.py --mib 4"
    assert document["report"] == "arm  ms/call\nnone  1.5\n"
    assert document["results"] == [{"arm": "none", "ms": 1.5}]
    assert "CPUs" in document["machine"]
    assert document["settings"] == {"mib": 4, "table": "data/t"}


def test_a_stale_block_is_rewritten(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps(
        {"command": "python tools/demo.py", "machine": "2 CPUs", "date": "2026-12-01",
         "report": "figures\n", "results": None}))
    page = "intro\n<!-- figures: run.json -->\nold figures\n<!-- /figures -->\nafter\n"
    new, stale = figures.updated(page, tmp_path)
    assert stale == ["run.json"]
    assert new == ("intro\n<!-- figures: run.json -->\n```\n$ python tools/demo.py\nfigures\n```\n"
                   "*2 CPUs; 2026-12-01.*\n<!-- /figures -->\nafter\n")
    assert figures.updated(new, tmp_path) == (new, [])
