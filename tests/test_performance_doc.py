"""The pages of full runs in docs/figures/ show its benchmark documents as
tools/figures.py renders them (the pages are kept current from the tools'
--json output), every one of them once; docs/performance.md, which sums them
up, links every page; and a tool's --json document holds what the run
printed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ple_tools import figures


def test_every_block_of_the_pages_is_its_document():
    names, stale = [], []
    for path in figures.pages():
        page = path.read_text()
        names += [m["name"] for m in figures.BLOCK.finditer(page)]
        stale += figures.updated(page, figures.FIGURES)[1]
    assert sorted(names) == sorted(p.name for p in figures.FIGURES.glob("*.json")), \
        "every document in docs/figures/ is shown once, and only those"
    assert stale == [], f"stale blocks (run python tools/figures.py): {stale}"


def test_the_performance_page_links_every_page_of_full_runs():
    summary = figures.pages()[0].read_text()
    for path in figures.pages()[1:]:
        assert f"](figures/{path.name}" in summary, path.name


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
