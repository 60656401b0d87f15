"""Benchmark figures as data, and the pages of full runs made from them.

A tool run with ``--json PATH`` writes one document there: the command that
ran, the machine, the date, the report it printed and its results.  The
documents live in docs/figures/, and the pages there (``docs/figures/*.md``,
the full runs that docs/performance.md sums up) name each one between two
markers,

    <!-- figures: bench_gpu-h200.json -->
    ...the document's command and report, as this module renders them...
    <!-- /figures -->

and ``python tools/figures.py`` rewrites every such block from its document
(``--check``: exits 1, naming the stale blocks, instead of writing).  The
prose around the blocks is the pages' own.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from ple_tools.argtypes import OutputFile, physical_memory, size
from ple_tools.written import DirectoryError

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "docs" / "figures"
BLOCK = re.compile(r"(<!-- figures: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)


def machine() -> str:
    """One line on where a tool runs: CPUs, GPU, torch, kernel."""
    parts = [f"{os.cpu_count()} CPUs"]
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.cuda.is_available():
            parts.append(torch.cuda.get_device_name())
        parts.append(f"torch {torch.__version__}")
    parts.append(f"Linux {platform.release()}")
    return ", ".join(parts)


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def without_json(arguments: list[str]) -> list[str]:
    """A tool's arguments less ``--json PATH``: the command that makes the
    figures, wherever their document goes."""
    kept, skip = [], False
    for argument in arguments:
        if skip:
            skip = False
        elif argument == "--json":
            skip = True
        elif not argument.startswith("--json="):
            kept.append(argument)
    return kept


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """A tool's ``--json PATH`` option, which run_recorded writes to."""
    parser.add_argument("--json", action=OutputFile, metavar="PATH",
                        help="also write the run as a JSON document (tools/figures.py)")


def parse_with_defaults(parser: argparse.ArgumentParser, argv, defaults: dict, quick: dict
                        ) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with the options left unset taken from
    ``quick`` under ``--quick``, else from ``defaults``; a tool with a memory
    cap (``--memory-limit``, ``--ballast``, in MiB) has them checked
    together, and the cap against the machine's memory (a cgroup limit above
    it caps nothing)."""
    args = parser.parse_args(argv)
    for key, value in (quick if args.quick else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if getattr(args, "ballast", 0) and args.memory_limit is None:
        parser.error("--ballast needs --memory-limit")
    if getattr(args, "memory_limit", None) is not None:
        if args.ballast >= args.memory_limit:
            parser.error("--ballast must be less than --memory-limit")
        if args.memory_limit * 2**20 > physical_memory():
            parser.error(f"argument --memory-limit: a cap of {size(args.memory_limit * 2**20)} "
                         f"caps nothing on this machine of {size(physical_memory())}")
    return args


def run_recorded(args: argparse.Namespace, tool: str, argv: list[str] | None,
                 run: Callable[[], tuple[int, object]]) -> int:
    """Calls ``run()``, which prints its report and returns (exit status,
    results as data); with ``args.json``, the printed report is kept as well
    and the document written there, with every option's value as parsed
    (``settings``: the defaults too, which the command line leaves out).
    ``tool``: the tool's file name in tools/ (``bench_gpu``); ``argv``: its
    arguments (None: sys.argv's).  Returns the status: 2, with the error
    printed and no document, when ``run()`` refuses the directory it was
    given (ple_tools.written.DirectoryError)."""
    path = args.json
    kept = io.StringIO()
    try:
        if path is None:
            return run()[0]
        with contextlib.redirect_stdout(_Tee(sys.stdout, kept)):
            status, results = run()
    except DirectoryError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    arguments = sys.argv[1:] if argv is None else argv
    document = {"command": shlex.join(["python", f"tools/{tool}.py", *without_json(arguments)]),
                "machine": machine(), "date": datetime.date.today().isoformat(),
                "settings": {name: value for name, value in vars(args).items()
                             if name not in ("json", "child")},
                "report": kept.getvalue(), "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    # default=str: paths among the settings
    path.write_text(json.dumps(document, indent=1, default=str) + "\n")
    return status


def render(document: dict) -> str:
    """A document as the page shows it: the command and the report, then the machine."""
    return (f"```\n$ {document['command']}\n{document['report'].rstrip()}\n```\n"
            f"*{document['machine']}; {document['date']}.*\n")


def pages() -> list[Path]:
    """The pages that show figure blocks: docs/performance.md and the full runs."""
    return [REPO / "docs" / "performance.md", *sorted(FIGURES.glob("*.md"))]


def updated(page: str, figures: Path) -> tuple[str, list[str]]:
    """The page with every block rendered from its document, and the names
    of the blocks that changed."""
    changed = []

    def block(match: re.Match) -> str:
        name = match["name"]
        body = render(json.loads((figures / name).read_text()))
        if body != match["body"]:
            changed.append(name)
        return match[1] + body + match[4]

    return BLOCK.sub(block, page), changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Rewrites the figure blocks of the pages in docs/figures/ (and "
                    "docs/performance.md) from the benchmark documents there.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1, naming them, if any block is stale")
    args = parser.parse_args(argv)
    stale = False
    for path in pages():
        page, changed = updated(path.read_text(), FIGURES)
        if args.check:
            if changed:
                print(f"stale in {path.name}: {', '.join(changed)} (run python tools/figures.py)")
                stale = True
            continue
        if changed:
            path.write_text(page)
            print(f"{path.name}: {len(changed)} block(s) rewritten: {', '.join(changed)}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
