"""Makes a small FP8 table (256 MiB by default) and gathers random rows from
it, cold and warm, with each prefetch policy.

    ple-demo [--mib 256] [--calls 8] [--rows 18000]     (or python tools/demo.py, make demo)

Cold calls drop the table's pages from the page cache first.  Every arm
gathers the same ids; the tool checks that every arm returns the same bytes
and exits non-zero when they differ.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ple_tools.argtypes import (positive_float, positive_int, refuse_empty_table,
                                refuse_over_memory, seed)
from ple_tools.figures import add_json_option, run_recorded
from ple_tools.make_table import refuse_table

if TYPE_CHECKING:  # for annotations; imported after parsing
    import torch

    import ple

ARMS = ("none", "all", "distance:4096", "window:256", "window:4096")

LEGEND = """\
columns: ms/call = median time of one gather; rows/s = ids gathered per second over all calls;
per call: pages = distinct 4 KiB file pages under the rows, advised = pages the policy asked the
kernel to read ahead, evicted = advised pages reclaimed before they were copied, read MiB = what
this process read from the disk (readahead included), maj.flt = faults that waited for the disk."""


def conclusion(results: list[dict]) -> str:
    """One line on what the figures mean: the best cold policy against no
    advice, and what the warm calls cost."""
    cold = [r for r in results if r["state"] == "cold"]
    warm = [r for r in results if r["state"] == "warm"]
    none = next(r for r in cold if r["arm"] == "none")
    best = min(cold, key=lambda r: r["ms"])
    warm_ms = [r["ms"] for r in warm]
    if all(r["read_mib"] == 0 for r in results):
        return (f"what it means: nothing came from the disk, so cold and warm calls both "
                f"measure the copy from memory ({min(warm_ms):.2f} to {max(warm_ms):.2f} ms)")
    if best is none:
        return (f"what it means: cold, every call waits for the disk, and here no advice "
                f"(none, {none['ms']:.1f} ms per call) was as fast as any policy; warm, the rows "
                f"are in memory and every policy takes {min(warm_ms):.2f} to {max(warm_ms):.2f} ms")
    return (f"what it means: cold, every call waits for the disk, and {best['arm']} "
            f"({best['ms']:.1f} ms per call) is {none['ms'] / best['ms']:.1f}x as fast as no "
            f"advice (none, {none['ms']:.1f} ms) because it has the disk read the pages ahead "
            f"of the copy; warm, the rows are in memory and every policy takes "
            f"{min(warm_ms):.2f} to {max(warm_ms):.2f} ms")


def disk_read_bytes() -> int:
    """Bytes this process has had read from the block device (readahead too)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def make_requests(num_rows: int, calls: int, rows: int, seed: int) -> list[torch.Tensor]:
    """``calls`` requests of ``rows`` random ids, the same for every seed."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, num_rows, (rows,), generator=generator) for _ in range(calls)]


def run_arm(table: ple.Table, arm: str, requests: list[torch.Tensor], cold: bool) -> dict:
    import torch

    import ple

    table.config = ple.GatherConfig.from_spec(arm)
    table.reset_stats()
    digest = hashlib.sha256()
    times, read = [], 0
    for ids in requests:
        if cold:
            table.drop_page_cache()
        before = disk_read_bytes()
        start = time.perf_counter()
        rows = torch.ops.ple.disk_gather_bytes(ids, table.handle)
        times.append(time.perf_counter() - start)
        read += disk_read_bytes() - before
        digest.update(rows.numpy().tobytes())
    stats, calls = table.stats(), len(requests)
    return {
        "arm": arm, "state": "cold" if cold else "warm",
        "ms": statistics.median(times) * 1e3,
        "rows_per_s": sum(len(r) for r in requests) / sum(times),
        "pages": stats["unique_pages"] / calls,
        "advised": stats["advised_pages"] / calls,
        "evicted": stats["evicted_before_copy"] / calls,
        "read_mib": read / calls / 2**20,
        "major_faults": stats["major_faults"] / calls,
        "sha256": digest.hexdigest(),
    }


def print_table(results: list[dict]) -> None:
    header = (f"{'arm':<14} {'state':<5} {'ms/call':>9} {'rows/s':>11} {'pages':>8} "
              f"{'advised':>8} {'evicted':>8} {'read MiB':>9} {'maj.flt':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['arm']:<14} {r['state']:<5} {r['ms']:>9.2f} {r['rows_per_s']:>11,.0f} "
              f"{r['pages']:>8.0f} {r['advised']:>8.0f} {r['evicted']:>8.0f} "
              f"{r['read_mib']:>9.1f} {r['major_faults']:>8.0f}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, default=Path("data/demo_table"),
                        help="the table's directory: reused if ple wrote a table of this size "
                        "there, else written there; a directory holding files ple did not "
                        "write is refused (default data/demo_table)")
    parser.add_argument("--mib", type=positive_float, default=256,
                        help="table size in MiB (default 256)")
    parser.add_argument("--row-bytes", type=positive_int, default=160,
                        help="bytes (FP8 values) per row (default 160)")
    parser.add_argument("--calls", type=positive_int, default=8, help="calls per arm (default 8)")
    parser.add_argument("--rows", type=positive_int, default=18000,
                        help="ids per call (default 18000)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random ids (default 0)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    refuse_empty_table(parser, "--mib", args.mib * 2**20, args.row_bytes)
    refuse_over_memory(parser, "--rows",
                       args.calls * args.rows * 8 + 2 * args.rows * args.row_bytes,
                       f"{args.calls:,} calls of {args.rows:,} ids (and a call's rows)")
    refuse_table(parser, args.table, rows=int(args.mib * 2**20) // args.row_bytes,
                 row_bytes=args.row_bytes,
                 options={"directory": "--table", "size": "--mib"})
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_recorded(args, "demo", argv, lambda: run(args))


def run(args: argparse.Namespace) -> tuple[int, list[dict]]:
    import torch

    import ple
    from ple_tools.make_table import PREFIX, ensure_table

    num_rows = int(args.mib * 2**20) // args.row_bytes
    ensure_table(args.table, rows=num_rows, row_bytes=args.row_bytes)
    requests = make_requests(num_rows, args.calls, args.rows, args.seed)
    results = []
    with ple.Table.from_safetensors(args.table, PREFIX) as table:
        print(f"{table}\n{args.calls} calls of {args.rows:,} random ids per arm; "
              f"cold = page cache dropped before each call\n", file=sys.stderr)
        results += [run_arm(table, arm, requests, cold=True) for arm in ARMS]
        for ids in requests:  # bring every requested page in before the warm arms
            torch.ops.ple.disk_gather_bytes(ids, table.handle)
        results += [run_arm(table, arm, requests, cold=False) for arm in ARMS]
    print_table(results)
    digests = {r["sha256"] for r in results}
    if len(digests) != 1:
        print(f"FAIL: arms returned different bytes: {digests}", file=sys.stderr)
        return 1, results
    print(f"\nevery arm returned the same bytes (sha256 {digests.pop()[:16]}...)")
    if all(r["read_mib"] == 0 for r in results):
        print("note: nothing was read from disk; the page cache could not be dropped "
              "(a tmpfs or an overlay without a block device?)")
    print(f"\n{LEGEND}\n{textwrap.fill(conclusion(results), width=96)}")
    return 0, results


if __name__ == "__main__":
    sys.exit(main())
