"""Measures what an n-gram PLE layer costs a serving loop on CPU: NGramEmbedding
over a table on disk, in steps of prefill or decode, cold, cold with the next
step prefetched while this one computes, and warm.

    ple-bench-layers [--table data/bench_table] [--tokens 2048] [--steps 8] [--compute-ms 50]
                     (or python tools/bench_layers.py ...)

Each step hashes ``--tokens`` random tokens (4 requests, 16 heads each) and
gathers their rows.  ``forward ms`` is how long ``layer(...)`` blocks the
step.  In the ``prefetch`` mode, step n + 1's rows are prefetched right after
step n's forward, and ``--compute-ms`` of sleep stands for the rest of the
model's step, so the prefetch has that long to read them.  Cold modes drop
the table's pages first; every mode gathers the same ids and must return the
same values.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ple_tools.argtypes import (milliseconds, positive_float, positive_int, refuse_empty_table,
                                refuse_over_memory, seed)
from ple_tools.figures import add_json_option, run_recorded
from ple_tools.make_table import refuse_table

if TYPE_CHECKING:  # for annotations; imported after parsing
    import torch
    from ple.layers import NGramEmbedding

VOCAB_SIZE = 262_144
ROW_BYTES = 160
EOS_ID = 1
REQUESTS = 4
HEADS = 16  # the layer's: 2-grams and 3-grams, 8 heads each
MODES = ("cold", "prefetch", "warm")


def make_steps(tokens: int, steps: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        token_ids = torch.randint(0, VOCAB_SIZE, (tokens,), generator=generator)
        seq_ids = torch.arange(tokens) * REQUESTS // max(tokens, 1)
        context = torch.randint(0, VOCAB_SIZE, (REQUESTS, 2), generator=generator)
        batches.append((token_ids, seq_ids, context))
    return batches


def run_mode(layer: NGramEmbedding, mode: str, steps, compute_ms: float) -> dict:
    from ple_tools.demo import disk_read_bytes

    layer.table.reset_stats()
    if mode != "warm":
        layer.table.drop_page_cache()
    read0 = disk_read_bytes()
    forward_ms, outputs = [], []
    if mode == "prefetch":
        layer.prefetch(*steps[0])
    for n, step in enumerate(steps):
        start = time.perf_counter()
        outputs.append(layer(*step))
        forward_ms.append((time.perf_counter() - start) * 1e3)
        if mode == "prefetch" and n + 1 < len(steps):
            layer.prefetch(*steps[n + 1])
        time.sleep(compute_ms / 1e3)
    stats = layer.table.stats()
    return {"mode": mode, "forward_ms": forward_ms, "outputs": outputs,
            "read_mib": (disk_read_bytes() - read0) / 2**20, "stats": stats}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, default=Path("data/bench_table"),
                        help="the table's directory: reused if ple wrote a table of this size "
                        "there, else written there; a directory holding files ple did not "
                        "write is refused (default data/bench_table)")
    parser.add_argument("--table-gib", type=positive_float, default=8.0,
                        help="table size in GiB, written when --table holds no table of this "
                        "size (default 8)")
    parser.add_argument("--tokens", type=positive_int, default=2048,
                        help="tokens per step (default 2048)")
    parser.add_argument("--steps", type=positive_int, default=8, help="steps per mode (default 8)")
    parser.add_argument("--compute-ms", type=milliseconds, default=50.0,
                        help="ms of sleep after each forward, standing for the rest of the "
                        "model's step (default 50)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the tokens (default 0)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    refuse_empty_table(parser, "--table-gib", args.table_gib * 2**30, ROW_BYTES)
    # Every mode's outputs, kept to compare them: a token's heads of bf16 rows.
    refuse_over_memory(parser, "--tokens", len(MODES) * args.steps * args.tokens * HEADS * ROW_BYTES
                       * 2, f"{len(MODES)} modes of {args.steps:,} steps of {args.tokens:,} tokens")
    num_rows = int(args.table_gib * 2**30) // ROW_BYTES
    refuse_table(parser, args.table, rows=num_rows, row_bytes=ROW_BYTES,
                 options={"directory": "--table", "size": "--table-gib"})
    from ple.layers import NGramHashing  # torch: the arguments are good so far

    hashing = NGramHashing(vocab_size=VOCAB_SIZE, eos_id=EOS_ID, base_size=max(1, num_rows // 17))
    if hashing.rows > num_rows:
        parser.error(f"argument --table-gib: the layer's hashing ({hashing.heads} heads of primes "
                     f"from {hashing.base_size:,}) takes {hashing.rows:,} rows, more than the "
                     f"table's {num_rows:,}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_recorded(args, "bench_layers", argv, lambda: run(args))


def run(args: argparse.Namespace) -> tuple[int, list[dict]]:
    import torch

    from ple.layers import NGramEmbedding
    from ple_tools.make_table import PREFIX, ensure_table

    num_rows = int(args.table_gib * 2**30) // ROW_BYTES
    ensure_table(args.table, rows=num_rows, row_bytes=ROW_BYTES)
    # 16 heads of consecutive primes from base_size must fit in the table.
    base_size = max(1, num_rows // 17)
    layer = NGramEmbedding.from_safetensors(args.table, PREFIX, vocab_size=VOCAB_SIZE, eos_id=EOS_ID,
                                            base_size=base_size, dtype=torch.bfloat16)
    steps = make_steps(args.tokens, args.steps, args.seed)
    print(f"{layer}\n{args.steps} steps of {args.tokens} tokens ({args.tokens * layer.hashing.heads:,} rows), "
          f"{args.compute_ms:g} ms of compute after each", file=sys.stderr)
    results = [run_mode(layer, mode, steps, args.compute_ms) for mode in MODES]

    print(f"{'mode':10} {'forward ms median':>18} {'min':>8} {'max':>8} {'read MiB':>9} "
          f"{'prefetch hits':>14} {'major faults':>13}")
    for r in results:
        ms = r["forward_ms"]
        print(f"{r['mode']:10} {statistics.median(ms):18.2f} {min(ms):8.2f} {max(ms):8.2f} "
              f"{r['read_mib']:9.1f} {r['stats']['prefetch_hits']:14d} "
              f"{r['stats']['major_faults']:13d}")
    reference = results[0]["outputs"]
    for r in results[1:]:
        if not all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                   for a, b in zip(reference, r["outputs"])):
            print(f"FAIL: mode {r['mode']} returned other values than cold", file=sys.stderr)
            return 1, None
    print("every mode returned the same values", file=sys.stderr)
    layer.table.close()
    return 0, [{k: v for k, v in r.items() if k != "outputs"} for r in results]


if __name__ == "__main__":
    sys.exit(main())
