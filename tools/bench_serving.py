"""Benchmarks the gather as a server sees it: rows that repeat the way n-grams
do, many calls, and a memory cap that leaves a budget B for caching.

    ple-bench-serving [--table-gib 4] [--budget 256] [--zipf 1.1]
                      [--rows 4096] [--warmup 3000] [--calls 300]
                      [--arms mmap,mmap-cache,direct-cache] [--json PATH]
    (or python tools/bench_serving.py ...)

Every call draws --rows ids from a Zipf distribution over the table's rows
(exponent --zipf; rank r is row (r - 1) * A mod N, A coprime to N near N
over the golden ratio, so that hot rows lie spread over the table as hashed
n-gram ids do; a fixed seed, the same ids for every arm).  Arms, each in a
child process of its own inside a memory cgroup whose limit is the child's
own memory once the table is open (Python, torch, the output) plus B, so
that B is what caching may take:

  mmap            the default gather (mmap window): the page cache holds
                  what B leaves room for
  mmap-cache      the same with a row cache sized to B (its rows and index):
                  the page cache gets what the row cache leaves
  direct-cache    GatherConfig(io="direct") with a row cache sized to B: no
                  page cache at all

The arms run one after another, not by turns: the page cache is the
machine's, and an mmap arm running beside another would be served pages
that the other read.  Run the tool again to see how much its ratios move.

Before the arms, every page that any call asks for is read once with
O_DIRECT (untimed; --no-prime skips it): a virtual disk's host may cache
what the guest reads, and without this pass the later arms would find in
the host's cache the pages that the earlier arms read.

The first --warmup calls fill the caches, untimed.  At the defaults a row
cache of B holds about 1.45 million rows; the first 300 calls ask for
247,000 distinct ids, the first 3,000 for 1.53 million: after 300 the row
cache is a sixth full and its misses are ids never seen before, which every
design reads, while after 3,000 it is full, as a server's is after its
first minutes.  The next --calls are measured: time per call, bytes read
from the disk per call (/proc/self/io read_bytes of the child), CPU time
per call, the row cache's hit rate and (mmap arms) the share of pages the
page cache held.  The page cache of the table is dropped before each arm.  Ratios of the mmap arm's figures over
the other arms' follow; the tool judges none of them.

Where this process cannot create a memory cgroup (no root, a read-only
cgroup filesystem), the tool says so and runs the arms without the cap: then
the page cache can take all the machine's memory, and the figures say
nothing about a capped server.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ple_tools.arm_child import module_command
from ple_tools.argtypes import (gather_threads, non_negative_int, number_above, positive_float,
                                positive_int, refuse_empty_table, refuse_over_memory, seed)
from ple_tools.figures import add_json_option, run_recorded
from ple_tools.make_table import refuse_table

MiB = 2**20
ARMS = ("mmap", "mmap-cache", "direct-cache")
# The row cache's own memory per row beside the row (ids, CLOCK bits and
# index: row_cache.h says 17 to 25 bytes): a row cache "sized to B" holds
# B / (row_bytes + this) rows.
ROW_CACHE_OVERHEAD = 25
# Room in the limit beyond B for what the arm itself allocates while it runs
# (the direct reader's buffers, page tables of the mapped pages, allocator slack).
SLACK_MIB = 16


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, default=Path("data/bench_table"),
                        help="the table's directory: reused if ple wrote a table of this size "
                        "there, else written there; a directory holding files ple did not "
                        "write is refused (default data/bench_table)")
    parser.add_argument("--table-gib", type=positive_float, default=4.0,
                        help="table size in GiB (default 4)")
    parser.add_argument("--row-bytes", type=positive_int, default=160,
                        help="bytes per row (default 160)")
    parser.add_argument("--budget", type=positive_int, default=256, metavar="MiB",
                        help="B: the memory the cap leaves for caching (default 256)")
    parser.add_argument("--zipf", type=number_above(1), default=1.1,
                        help="exponent of the Zipf distribution of the ids, above 1 (default 1.1)")
    parser.add_argument("--rows", type=positive_int, default=4096,
                        help="ids per call (default 4096)")
    parser.add_argument("--warmup", type=non_negative_int, default=3000,
                        help="untimed calls first (default 3000)")
    parser.add_argument("--calls", type=positive_int, default=300,
                        help="measured calls (default 300)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the ids (default 0)")
    parser.add_argument("--threads", type=gather_threads,
                        help="GatherConfig.threads (default: its default)")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma separated, of {', '.join(ARMS)} (default all)")
    parser.add_argument("--no-prime", dest="prime", action="store_false",
                        help="skip the pass that reads every page of every call once with "
                        "O_DIRECT before the arms (see above)")
    add_json_option(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    refuse_empty_table(parser, "--table-gib", args.table_gib * 2**30, args.row_bytes)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; expected some of {', '.join(ARMS)}")
    num_rows = int(args.table_gib * 2**30) // args.row_bytes
    share = share_in_table(args.zipf, num_rows)
    if share < LEAST_SHARE:
        parser.error(f"argument --zipf: {args.zipf:g} is so near 1 that {share:.2%} of the "
                     f"distribution's draws fall in the table's {num_rows:,} rows: drawing "
                     f"the ids would take {1 / share:,.0f} draws an id")
    refuse_over_memory(parser, "--budget", args.budget * MiB, f"a budget of {args.budget:,} MiB")
    refuse_over_memory(parser, "--rows", (args.warmup + args.calls) * args.rows * 8,
                       f"{args.warmup + args.calls:,} calls of {args.rows:,} ids")
    if not args.child:
        refuse_table(parser, args.table, rows=num_rows, row_bytes=args.row_bytes,
                     options={"directory": "--table", "size": "--table-gib"})
    return args


# The least share of the Zipf distribution's draws in the table that the
# tool takes: below it, drawing the ids (and NumPy's zipf itself) all but hangs.
LEAST_SHARE = 0.01


def share_in_table(exponent: float, num_rows: int) -> float:
    """The share of Zipf(``exponent``) draws in [1, num_rows]: the sums of
    k**-exponent to num_rows and to infinity, each its first 1,000 terms
    and the integral of the rest."""
    head = min(num_rows, 1000)
    partial = math.fsum(k ** -exponent for k in range(1, head + 1))
    rest = head ** (1 - exponent) / (exponent - 1)  # the integral from head to infinity
    beyond = num_rows ** (1 - exponent) / (exponent - 1)
    return (partial + rest - beyond) / (partial + rest) if num_rows > head else (
        partial / (partial + rest))


def zipf_requests(num_rows: int, calls: int, rows: int, exponent: float, seed: int):
    """``calls`` int64 arrays of ``rows`` ids: Zipf ranks over [1, num_rows]
    (draws past num_rows are drawn again), rank r as row (r - 1) * A mod N."""
    import math

    import numpy as np

    rng = np.random.default_rng(seed)
    spread = int(num_rows / ((1 + math.sqrt(5)) / 2)) | 1
    while math.gcd(spread, num_rows) != 1:
        spread += 2
    out = []
    for _ in range(calls):
        ranks = np.empty(0, dtype=np.int64)
        while len(ranks) < rows:
            draw = rng.zipf(exponent, 2 * rows)
            ranks = np.concatenate([ranks, draw[draw <= num_rows]])
        out.append(((ranks[:rows] - 1) * spread) % num_rows)
    return out


def arm_config(arm: str, budget_bytes: int, row_bytes: int, threads: int | None):
    import ple

    fields = {"threads": threads} if threads else {}
    if arm == "mmap":
        return ple.GatherConfig(**fields)
    cache_mib = max(1, budget_bytes * row_bytes // (row_bytes + ROW_CACHE_OVERHEAD) // MiB)
    io = "direct" if arm == "direct-cache" else "mmap"
    return ple.GatherConfig(io=io, row_cache_mib=cache_mib, **fields)


def child_main(spec_json: str) -> None:
    """One arm in a child: enters the cgroup, opens the table, sets the limit
    to its memory so far plus B, runs the calls, writes a record to the pipe."""
    import hashlib
    import resource
    import time

    import torch

    import ple
    from ple_tools.cgroup import MemoryCgroup
    from ple_tools.demo import disk_read_bytes
    from ple_tools.make_table import PREFIX

    spec = json.loads(spec_json)
    group = None
    if spec["cgroup"]:
        group = MemoryCgroup.attach(spec["cgroup"], spec["cgroup_version"], spec["limit"])
        group.enter()
    table = ple.Table.from_safetensors(spec["table"], PREFIX)
    requests = zipf_requests(table.num_rows, spec["warmup"] + spec["calls"], spec["rows"],
                             spec["zipf"], spec["seed"])
    out = torch.zeros((spec["rows"], table.row_bytes), dtype=torch.uint8)
    table.drop_page_cache()
    table.config = arm_config(spec["arm"], spec["budget"], table.row_bytes, spec["threads"])
    record = {"arm": spec["arm"], "config": repr(table.config), "io_backend": table.io_backend}
    if group is not None:
        base = group.usage() - group.cache_and_anon()[0]  # without page cache
        group.set_limit(base + spec["budget"] + SLACK_MIB * MiB)
        record["cgroup"] = {"base_bytes": base, "limit_bytes": group.limit}
    for ids in requests[:spec["warmup"]]:
        table.gather_bytes(torch.from_numpy(ids), out=out)
    calls, digest = [], hashlib.sha256()
    for ids in requests[spec["warmup"]:]:
        before, read0 = table.stats(), disk_read_bytes()
        cpu0, start = time.process_time(), time.perf_counter()
        table.gather_bytes(torch.from_numpy(ids), out=out)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
        after = table.stats()
        delta = {k: after[k] - before[k] for k in after}
        calls.append({"ms": seconds * 1e3, "cpu_ms": cpu * 1e3, "read_bytes": disk_read_bytes() - read0,
                      "row_cache_hits": delta["row_cache_hits"],
                      "row_cache_misses": delta["row_cache_misses"],
                      "unique_pages": delta["unique_pages"], "resident_pages": delta["resident_pages"],
                      "direct_reads": delta["direct_reads"]})
        digest.update(out.numpy().data)
    record["calls"], record["sha256"] = calls, digest.hexdigest()
    record["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if group is not None:
        cache, anon = group.cache_and_anon()
        record["cgroup"].update({"cache_end": cache, "anon_end": anon, "usage_end": group.usage(),
                                 "peak": group.peak()})
    table.close()
    with os.fdopen(spec["fd"], "w") as pipe:
        json.dump(record, pipe)


def run_arm(args, arm: str, capped: bool) -> dict:
    """Runs one arm in a child process (in a fresh memory cgroup when capped)."""
    from ple_tools.cgroup import MemoryCgroup

    # The child lowers the limit once it knows its own memory; until then, room.
    group = MemoryCgroup(f"ple-serving-{os.getpid()}-{arm}", 64 * 1024) if capped else None
    try:
        read_fd, write_fd = os.pipe()
        spec = {"table": str(args.table), "arm": arm, "rows": args.rows, "warmup": args.warmup,
                "calls": args.calls, "zipf": args.zipf, "seed": args.seed,
                "budget": args.budget * MiB, "threads": args.threads, "fd": write_fd,
                "cgroup": str(group.path) if group else None,
                "cgroup_version": group.version if group else None,
                "limit": group.limit if group else None}
        command = module_command("ple_tools.bench_serving", "--child", json.dumps(spec))
        child = subprocess.Popen(command, pass_fds=(write_fd,))
        os.close(write_fd)
        with os.fdopen(read_fd) as pipe:
            text = pipe.read()
        code = child.wait()
        if code != 0 or not text:
            kills = group.oom_kills() if group else 0
            raise RuntimeError(f"the child was OOM-killed ({kills} in its cgroup)" if kills
                               else f"the child exited with {code}")
        return json.loads(text)
    finally:
        if group is not None:
            group.remove()


def summarize(record: dict) -> dict:
    calls = record.pop("calls")

    def total(key: str):
        return sum(c[key] for c in calls)

    looked_up = total("row_cache_hits") + total("row_cache_misses")
    record.update({
        "ms_median": statistics.median(c["ms"] for c in calls),
        "ms_mean": statistics.fmean(c["ms"] for c in calls),
        "cpu_ms_per_call": total("cpu_ms") / len(calls),
        "read_bytes_per_call": total("read_bytes") / len(calls),
        "direct_reads_per_call": total("direct_reads") / len(calls),
        "row_cache_hit_rate": total("row_cache_hits") / looked_up if looked_up else None,
        # pages that mincore found in the page cache, of those the disk-tier rows needed
        "page_cache_hit_rate": (total("resident_pages") / total("unique_pages")
                                if record["io_backend"] == "mmap" and total("unique_pages") else None),
        "per_call": calls})
    return record


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(results: list[dict], setup: str) -> dict:
    print()
    print(setup)
    header = (f"{'arm':<13} {'backend':<9} {'median ms':>10} {'mean ms':>9} {'cpu ms':>8} "
              f"{'read KiB':>10} {'reads':>7} {'row hits':>9} {'page hits':>10}")
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['arm']:<13} FAILED: {r['error']}")
            continue
        print(f"{r['arm']:<13} {r['io_backend']:<9} {r['ms_median']:>10.2f} {r['ms_mean']:>9.2f} "
              f"{r['cpu_ms_per_call']:>8.2f} {r['read_bytes_per_call'] / 1024:>10.1f} "
              f"{r['direct_reads_per_call']:>7.0f} {fmt(r['row_cache_hit_rate'], '>9.1%')} "
              f"{fmt(r['page_cache_hit_rate'], '>10.1%')}")
    ok = {r["arm"]: r for r in results if "error" not in r}
    digests = {r["sha256"] for r in ok.values()}
    print("\nevery arm returned the same bytes" if len(digests) == 1 else
          f"\nFAIL: the arms returned different bytes ({len(digests)} digests)")
    ratios = {"same_bytes": len(digests) <= 1}
    if "mmap" in ok:
        print("\nthe mmap arm's figures over each arm's (mean time per call, bytes read per call):")
        for arm, r in ok.items():
            if arm == "mmap":
                continue
            ratios[arm] = {
                "mmap_time_over_time": ok["mmap"]["ms_mean"] / r["ms_mean"],
                "mmap_read_over_read": (ok["mmap"]["read_bytes_per_call"] / r["read_bytes_per_call"]
                                        if r["read_bytes_per_call"] else None)}
            print(f"  {arm:<13} time {ratios[arm]['mmap_time_over_time']:.2f}x, "
                  f"bytes read {fmt(ratios[arm]['mmap_read_over_read'], '.2f')}x")
    return ratios


def prime(layout, requests) -> None:
    """Reads every page under `requests` once with O_DIRECT (see the module's
    text: the host's cache then holds them for every arm alike)."""
    import numpy as np
    import torch

    from ple_tools.gather_arms import run_ceiling_arm

    every = torch.from_numpy(np.unique(np.concatenate(requests)))
    record = run_ceiling_arm(layout, "prime:64", [every], "arm", "aio")
    call = record["calls"][0]
    print(f"  primed {call['unique_pages']:,} pages in {call['ms'] / 1e3:.1f} s", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    return run_recorded(args, "bench_serving", argv, lambda: run(args))


def run(args: argparse.Namespace) -> tuple[int, dict]:
    from ple_tools.cgroup import CgroupError, MemoryCgroup
    from ple_tools.gather_arms import drop_files
    from ple_tools.make_table import PREFIX, ensure_table
    from ple_tools.table_layout import Layout

    try:
        MemoryCgroup(f"ple-serving-{os.getpid()}-probe", 64 * 1024).remove()
        capped = True
    except CgroupError as error:
        print(f"note: cannot create a memory cgroup ({error}): running WITHOUT the memory cap, "
              "so the page cache is not limited to the budget", file=sys.stderr)
        capped = False
    num_rows = int(args.table_gib * 2**30) // args.row_bytes
    ensure_table(args.table, rows=num_rows, row_bytes=args.row_bytes)
    layout = Layout.open(args.table, PREFIX)
    if args.prime:
        prime(layout, zipf_requests(num_rows, args.warmup + args.calls, args.rows, args.zipf,
                                    args.seed))
    setup = (f"{num_rows:,} rows of {args.row_bytes} B ({num_rows * args.row_bytes / 2**30:.2f} "
             f"GiB); Zipf ids, exponent {args.zipf}, seed {args.seed}; {args.warmup} warm-up and "
             f"{args.calls} measured calls of {args.rows:,} ids per arm; "
             + (f"memory cap = each child's memory + B ({args.budget} MiB) + {SLACK_MIB} MiB"
                if capped else f"NO memory cap (no cgroup); row caches of B = {args.budget} MiB"))
    print(setup, file=sys.stderr)
    load_before = os.getloadavg()[0]  # other jobs of a shared machine
    results = []
    for arm in args.arms.split(","):
        print(f"  {arm} ...", file=sys.stderr, flush=True)
        drop_files(layout.paths)
        try:
            results.append(summarize(run_arm(args, arm, capped)))
        except (RuntimeError, OSError) as error:
            print(f"  {arm} failed: {error}", file=sys.stderr)
            results.append({"arm": arm, "error": str(error)})
    load = (load_before, os.getloadavg()[0])
    ratios = report(results, setup)
    print(f"load average (1 min) {load[0]:.2f} before the arms, {load[1]:.2f} after")
    document = {"setup": setup, "capped": capped,
                "load_average_1min": {"before_arms": load[0], "after_arms": load[1]},
                "arms": results, "ratios": ratios}
    return (1 if any("error" in r for r in results) or not ratios["same_bytes"] else 0), document


if __name__ == "__main__":
    sys.exit(main())
