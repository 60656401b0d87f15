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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path,
                        help="where to write the tables (default: a temporary directory, removed "
                        "at the end)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="the torch device the model runs on (default: cuda when torch sees "
                        "a GPU, else cpu)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from ple_tools.tiny import run

    return run(args.out, args.device)


if __name__ == "__main__":
    sys.exit(main())
