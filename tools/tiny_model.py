"""Runs a tiny model over disk tables in every execution mode ple supports.

    ple-tiny-model [--out DIR] [--device cpu|cuda]     (or python tools/tiny_model.py ...)

Writes a small n-gram table (FP8 safetensors shards, tools/make_table.py) and a
small GGUF file with a Q8_0 ``token_embd.weight``, then runs a model whose
output is the packed token embedding plus a linear projection of the n-gram
embedding: a few chunks of a two-request prompt, eager, under
``torch.compile(fullgraph=True)``, and on CUDA also compiled with
``mode="reduce-overhead"`` and captured by hand in a CUDA graph.  Some rows
sit in the host tier (and the device tier on CUDA), each step prefetches the
next step's rows, and every mode must give the eager outputs bit for bit.
Prints each table's counters.  The model and its modes are in tools/tiny.py.

--out DIR keeps the tables there: a missing or empty directory, or one
holding the tables this tool wrote (its ple_tiny_model.json lists them, and
they are written again); a directory holding files it did not write is
refused before anything is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ple_tools import written

TOOL = "ple-tiny-model"
WHAT = "the tiny model's tables"
MARKER = "ple_tiny_model.json"  # in --out: the files the tool wrote there (ple_tools.written)
TABLES_BYTES = 4 << 20  # the two tables' files, at most


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path,
                        help="where to write the tables: a missing or empty directory, or one "
                        "holding the tables this tool wrote (default: a temporary directory, "
                        "removed at the end)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="the torch device the model runs on (default: cuda when torch sees "
                        "a GPU, else cpu)")
    args = parser.parse_args(argv)
    if args.out is not None:
        marker = args.out / MARKER
        record = written.read_record(marker, TOOL)
        try:
            written.refuse_foreign(args.out, marker, record, WHAT)
            written.refuse_no_room(args.out, TABLES_BYTES, record, WHAT)
        except written.DirectoryError as error:
            written.refuse_on_command_line(parser, error, "--out", "--out")
    if args.device == "cuda":
        import torch  # the arguments are good so far

        if not torch.cuda.is_available():
            parser.error(f"argument --device: cuda, and torch {torch.__version__} sees no CUDA "
                         "device (--device cpu runs on the CPU)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from ple_tools.tiny import run

    return run(args.out, args.device)


if __name__ == "__main__":
    sys.exit(main())
