"""Benchmarks the gather's prefetch policies against each other, against NumPy
and against what the disk serves, cold, warm and under memory pressure.

    ple-bench-gather [--table-gib 8 | --table-rows N] [--shards 8] [--files 4]
                     [--calls 16] [--rows 18000]
                     [--windows 64,1024,4096,16384] [--warm]
                     [--direct-cache MiB] [--direct-blocks BYTES,...]
                     [--direct-depths N,...] [--io-queue-depth N] [--cpu-load N]
                     [--memory-limit MiB --ballast MiB]
                     [--json PATH] [--plot PATH] [--quick]
    (or python tools/bench_gather.py ...)

Arms, each running the same calls with the same seeded random ids:

  none            no advice: every cold page is a synchronous fault
  all             every cold page advised first, then copied
  distance:KiB    advice for the pages less than KiB ahead of the copy address
  window:KiB      at most KiB of pages advised and not yet copied, per gather
                  thread (--threads; one arm per --windows value)
  direct          GatherConfig(io="direct"): the rows' blocks read with
                  O_DIRECT (io_uring, else AIO, else pread threads), no page
                  cache and no row cache: every call reads the disk
  direct-cache:MiB  the same with a row cache of MiB (--direct-cache): warm,
                  the rows come from it
  direct-block:BYTES  direct with reads of BYTES blocks (--direct-blocks;
                  direct's own are the files' direct-I/O alignment)
  direct-depth:N  direct with N reads in flight (--direct-depths; direct's
                  own is GatherConfig's io_queue_depth, or --io-queue-depth)
  ceiling:DEPTH   not a gather: the unique 4 KiB pages under each call's rows,
                  read with O_DIRECT (no page cache, no mmap) with DEPTH reads
                  in flight (Linux AIO, or --ceiling-engine threads: a pool of
                  DEPTH threads): what this disk serves for this access
                  pattern at that depth.  Produces no rows; reports time and
                  bytes.  (The gather's own queue can be deeper than DEPTH.)
  numpy           (warm only) NumPy fancy indexing of np.memmaps of the shards

Before the arms, the unique pages of every call are read once with O_DIRECT
(untimed for the arms; reported as the row prime:DEPTH).  A virtual disk's
host may cache what the guest reads (on the development machine, re-reading
the same random pages is 2.5x faster than reading them first), and every arm
reads the same pages: without this pass the first arm would pay for reads
that later arms get from the host's cache.  --no-prime skips it.

--cpu-load N runs N busy processes (Python loops) for the arms' duration, as
a server's other work loads its CPUs.  Column "cpu ms" is the CPU time of the
gathering process per call (every thread, kernel time included, from
time.process_time); "cpu us/pg" that over the call's unique pages.

The tool reports figures per arm and ratios of median times between arms
(against the fastest ceiling, against none, under a memory limit against all,
warm NumPy against each arm, direct arms against the default window arm and
their CPU per page against the ceiling's); it judges none of them.  Every gathering arm
must return the same bytes (SHA-256 over all calls); the tool exits non-zero
when they differ or an arm fails.

The parts: tools/gather_arms.py runs the arms, tools/table_layout.py says
where the rows lie (from ple.Table), tools/odirect.py reads pages with
O_DIRECT, tools/cgroup.py makes the memory cgroups, tools/cpu_load.py the
busy processes, tools/report.py prints the table and the ratios and draws
the plot.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ple_tools.argtypes import (OutputFile, gather_threads, io_block_bytes_list, io_queue_depth,
                                io_queue_depth_list, non_negative_int, positive_float,
                                positive_int, refuse_empty_table, refuse_over_memory,
                                row_cache_mib, seconds, seed, window_kib, window_kib_list)
from ple_tools.figures import add_json_option, parse_with_defaults, run_recorded
from ple_tools.make_table import refuse_table

if TYPE_CHECKING:  # for annotations; imported after parsing
    from ple_tools.table_layout import Layout

MiB = 2**20
DEFAULTS = dict(table_gib=8.0, calls=16, rows=18000, windows="64,1024,4096,16384",
                ceiling="32,64")
QUICK = dict(table_gib=0.25, calls=4, rows=4000, windows="64,4096", ceiling="32")
# What a busy process of --cpu-load takes: a Python interpreter.
BUSY_PROCESS_BYTES = 16 << 20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2] if __doc__.count("\n\n") >= 2 else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, default=Path("data/bench_table"),
                        help="the table's directory: reused if ple wrote a table of this size "
                        "there, else written there; a directory holding files ple did not "
                        "write is refused (default data/bench_table)")
    parser.add_argument("--table-gib", type=positive_float,
                        help="table size in GiB (default 8; --quick 0.25)")
    parser.add_argument("--table-rows", type=positive_int, metavar="N",
                        help="table size in rows, instead of --table-gib (the reference n-gram "
                        "table: 320001536)")
    parser.add_argument("--shards", type=positive_int, default=8,
                        help="shards the table's rows are split into (default 8; the reference "
                        "table: 128)")
    parser.add_argument("--files", type=positive_int, default=4,
                        help="files the shards are spread over (default 4; the reference table: "
                        "32), written in parallel (ple_tools.make_table)")
    parser.add_argument("--row-bytes", type=positive_int, default=160,
                        help="bytes (FP8 values) per row (default 160)")
    parser.add_argument("--calls", type=positive_int, help="calls per arm (default 16; --quick 4)")
    parser.add_argument("--rows", type=positive_int,
                        help="random ids per call (default 18000; --quick 4000)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the ids (default 0)")
    parser.add_argument("--windows", type=window_kib_list,
                        help="KiB budgets of the window:KiB arms, comma separated "
                        "(default 64,1024,4096,16384; --quick 64,4096)")
    parser.add_argument("--distance", type=window_kib, default=4096,
                        help="KiB of the distance:KiB arm (default 4096; 0: no arm)")
    parser.add_argument("--ceiling", type=io_queue_depth_list,
                        help="queue depths of the ceiling:DEPTH arms, comma "
                        "separated (default 32,64; --quick 32; empty: none)")
    parser.add_argument("--ceiling-engine", choices=("aio", "threads"), default="aio",
                        help="how the ceiling arms keep DEPTH O_DIRECT reads in flight: Linux "
                        "native AIO from one thread (default; falls back to threads where "
                        "unavailable), or a pool of DEPTH threads doing preadv (CPU bound near "
                        "40k reads/s on 2 cores)")
    parser.add_argument("--no-prime", dest="prime", action="store_false",
                        help="skip the pass that reads every call's pages once with O_DIRECT "
                        "before the arms (see above)")
    parser.add_argument("--threads", type=gather_threads,
                        help="GatherConfig.threads (default: its default)")
    parser.add_argument("--direct-cache", type=row_cache_mib, default=256, metavar="MiB",
                        help="row cache of the direct-cache:MiB arm (default 256; 0: no such arm)")
    parser.add_argument("--direct-blocks", type=io_block_bytes_list, default="",
                        metavar="BYTES,...",
                        help="io_block_bytes of direct-block:BYTES arms, comma separated "
                             "(default none)")
    parser.add_argument("--direct-depths", type=io_queue_depth_list, default="", metavar="N,...",
                        help="io_queue_depth of direct-depth:N arms, comma separated "
                             "(default none)")
    parser.add_argument("--no-direct", dest="direct", action="store_false",
                        help="leave out every direct arm (direct, direct-cache, direct-block, "
                             "direct-depth)")
    parser.add_argument("--io-queue-depth", type=io_queue_depth, metavar="N",
                        help="GatherConfig.io_queue_depth of the direct arms other than "
                             "direct-depth:N (default: its default)")
    parser.add_argument("--cpu-load", type=non_negative_int, default=0, metavar="N",
                        help="run N busy processes (Python loops) for the arms' duration "
                        "(default 0)")
    parser.add_argument("--drop", choices=("arm", "call"), default="arm",
                        help="cold runs drop the table's pages from the page cache (the tool's "
                        "table unmapped first, then posix_fadvise DONTNEED on each file) before "
                        "each arm (default: every call draws distinct random "
                        "ids, so its pages are mostly cold: column 'new' counts the pages no "
                        "earlier call of the arm asked for) or before each call ('call': every "
                        "call fully cold)")
    parser.add_argument("--warm", action="store_true",
                        help="after the cold arms, run every gathering arm and numpy again "
                        "without dropping, each after one untimed pass over its calls")
    parser.add_argument("--memory-limit", type=positive_int, metavar="MiB",
                        help="run each arm in its own child process in a memory cgroup of this "
                        "limit, which the tool creates and removes (needs root or a delegated "
                        "cgroup; exits non-zero without)")
    parser.add_argument("--ballast", type=non_negative_int, default=0, metavar="MiB",
                        help="touched anonymous memory the child allocates inside the cgroup "
                        "before the arm (with --memory-limit; there is no swap to take it).  The "
                        "page tables of the mapped table are charged to the group as well (about "
                        "25 MiB for random rows over an 8 GiB table): the tool prints the page "
                        "cache room that is really left")
    parser.add_argument("--arm-timeout", type=seconds, default=600, metavar="S",
                        help="with --memory-limit, an arm's child still running after S seconds "
                        "is killed and the arm reported as timed out (default 600)")
    add_json_option(parser)
    parser.add_argument("--plot", action=OutputFile, metavar="PATH",
                        help="write a PNG of time per call and bytes read per arm (needs matplotlib)")
    parser.add_argument("--quick", action="store_true",
                        help="a run of under a minute: 256 MiB table, 4 calls of 4000 rows, "
                        "windows 64 and 4096, ceiling:32 only (explicit flags still win)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parse_with_defaults(parser, argv, DEFAULTS, QUICK)
    if args.table_rows is None:
        refuse_empty_table(parser, "--table-gib", args.table_gib * 2**30, args.row_bytes)
    # Every call's ids, held for all the arms, and a call's rows (twice: the
    # output and the NumPy arm's).
    refuse_over_memory(parser, "--rows",
                       args.calls * args.rows * 8 + 2 * args.rows * args.row_bytes,
                       f"{args.calls:,} calls of {args.rows:,} ids (and a call's rows)")
    refuse_over_memory(parser, "--cpu-load", args.cpu_load * BUSY_PROCESS_BYTES,
                       f"{args.cpu_load:,} busy Python processes")
    if not args.child:
        refuse_table(parser, args.table, rows=table_rows(args), row_bytes=args.row_bytes,
                     shards=args.shards, files=args.files,
                     options={"directory": "--table", "shards": "--shards", "files": "--files",
                              "size": "--table-rows" if args.table_rows else "--table-gib"})
    return args


def table_rows(args: argparse.Namespace) -> int:
    return args.table_rows or int(args.table_gib * 2**30) // args.row_bytes


def arm_list(args) -> list[str]:
    arms = ["none", "all"]
    if args.distance:
        arms.append(f"distance:{args.distance}")
    arms += [f"window:{int(w)}" for w in args.windows.split(",") if w.strip()]
    if args.direct:
        arms.append("direct")
        if args.direct_cache:
            arms.append(f"direct-cache:{args.direct_cache}")
        arms += [f"direct-block:{int(b)}" for b in args.direct_blocks.split(",") if b.strip()]
        arms += [f"direct-depth:{int(d)}" for d in args.direct_depths.split(",") if d.strip()]
    return arms


def child_main(spec_json: str) -> None:
    """One arm in a child process: moves itself into the cgroup, touches the
    ballast, runs the arm, writes its result as a JSON line to the parent's file."""
    import numpy as np

    import ple
    from ple_tools.arm_child import write_line
    from ple_tools.cgroup import MemoryCgroup
    from ple_tools.demo import make_requests
    from ple_tools.gather_arms import arm_kind, run_arm
    from ple_tools.make_table import PREFIX
    from ple_tools.table_layout import PAGE, Layout

    spec = json.loads(spec_json)
    layout = Layout.open(spec["table"], PREFIX)
    requests = make_requests(layout.num_rows, spec["calls"], spec["rows"], spec["seed"])
    table = None
    if arm_kind(spec["arm"])[0] not in ("ceiling", "numpy"):
        table = ple.Table.from_safetensors(spec["table"], PREFIX)  # maps, reads no rows
    group = MemoryCgroup.attach(spec["cgroup"], spec["cgroup_version"], spec["limit"])
    group.enter()  # from here on, this process's new memory is charged to the group
    # private anonymous memory, every page touched: with no swap, nothing reclaims it
    ballast = mmap.mmap(-1, max(spec["ballast"], 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    np.frombuffer(ballast, dtype=np.uint8)[::PAGE] = 1
    after_ballast, stat0 = group.usage(), group.stat()
    record = run_arm(Path(spec["table"]), layout, spec["arm"], requests, spec["state"],
                     spec["drop"], spec["threads"], spec["engine"], table,
                     spec["io_queue_depth"])
    cache, anon = group.cache_and_anon()
    usage, stat1 = group.usage(), group.stat()
    refaults = "workingset_refault_file" if "workingset_refault_file" in stat1 else "workingset_refault"
    record["cgroup"] = {
        "version": group.version, "limit_bytes": group.limit, "ballast_bytes": spec["ballast"],
        "usage_after_ballast": after_ballast, "usage_end": usage, "peak": group.peak(),
        "cache_end": cache, "anon_end": anon,
        # file pages read again after the group's reclaim evicted them, during the arm
        "file_refaults": stat1.get(refaults, 0) - stat0.get(refaults, 0),
        # what the limit leaves for page cache once everything else is charged
        "cache_room_bytes": group.limit - (usage - cache)}
    if table is not None:
        table.close()
    write_line(spec, record)


def run_arm_in_cgroup(args, arm: str, state: str, index: int, layout: Layout) -> dict:
    """Runs one arm in a child process inside a memory cgroup made for it
    (and removed after); returns the child's record."""
    from ple_tools.arm_child import run_child
    from ple_tools.cgroup import MemoryCgroup
    from ple_tools.gather_arms import drop_files

    group = MemoryCgroup(f"ple-bench-{os.getpid()}-{index}", args.memory_limit)
    try:
        if state == "cold" and args.drop == "arm":
            drop_files(layout.paths)  # the parent maps nothing of the table
        spec = {"table": str(args.table), "row_bytes": args.row_bytes, "calls": args.calls,
                "rows": args.rows, "seed": args.seed, "arm": arm, "state": state,
                "drop": args.drop, "threads": args.threads, "engine": args.ceiling_engine,
                "io_queue_depth": args.io_queue_depth,
                "cgroup": str(group.path), "cgroup_version": group.version, "limit": group.limit,
                "ballast": args.ballast * MiB}
        run = run_child("ple_tools.bench_gather", spec, args.arm_timeout)
        if run.timed_out:
            raise RuntimeError(f"timed out: killed after {args.arm_timeout:.0f} s (--arm-timeout)")
        if run.code != 0 or not run.lines:
            kills = group.oom_kills()
            why = (f"the child was OOM-killed ({kills} OOM kill(s) in its cgroup): the limit "
                   f"of {args.memory_limit} MiB leaves too little beside {args.ballast} MiB "
                   "of ballast" if kills or run.code == -9 else f"the child exited with {run.code}")
            raise RuntimeError(why)
        return run.lines[-1]
    finally:
        group.remove()


def run_plan(args, plan, layout: Layout, requests, new_pages, table, pressure: bool,
             results: list[dict]) -> None:
    """Runs the arms of `plan` in order, appending each one's summary (or
    its error) to `results`."""
    from ple_tools import report
    from ple_tools.gather_arms import run_arm, run_ceiling_arm

    for index, (arm, state) in enumerate(plan):
        print(f"  {arm} {state} ...", file=sys.stderr, flush=True)
        try:
            if arm.startswith("prime:"):
                record = run_ceiling_arm(layout, arm, requests, "arm", args.ceiling_engine)
            elif pressure:
                record = run_arm_in_cgroup(args, arm, state, index, layout)
            else:
                record = run_arm(args.table, layout, arm, requests, state, args.drop,
                                 args.threads, args.ceiling_engine, table, args.io_queue_depth)
            results.append(report.summarize(record, args.rows, new_pages))
            print(f"  {arm} {state}: median {results[-1]['ms_median']:.1f} ms a call",
                  file=sys.stderr, flush=True)
        except (RuntimeError, OSError) as error:
            print(f"  {arm} {state} failed: {error}", file=sys.stderr)
            results.append({"arm": arm, "state": state, "error": str(error)})


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    return run_recorded(args, "bench_gather", argv, lambda: run(args))


def run(args: argparse.Namespace) -> tuple[int, dict | None]:
    from ple_tools.cgroup import CgroupError, MemoryCgroup

    pressure = args.memory_limit is not None
    if pressure:  # fail early and clearly without the rights to make a cgroup
        try:
            MemoryCgroup(f"ple-bench-{os.getpid()}-probe", args.memory_limit).remove()
        except CgroupError as error:
            hint = ("this process is root: is the cgroup filesystem read-only here, as in "
                    "many containers?" if os.geteuid() == 0 else "run as root, or inside a "
                    "cgroup v2 subtree delegated to this user")
            print(f"error: --memory-limit needs a memory cgroup that this tool creates, and it "
                  f"cannot: {error}; {hint}", file=sys.stderr)
            return 2, None

    import ple  # and torch, which run_recorded's machine line names
    from ple_tools import report
    from ple_tools.cpu_load import BusyProcesses
    from ple_tools.demo import make_requests
    from ple_tools.gather_arms import new_pages_per_call
    from ple_tools.make_table import PREFIX, ensure_table
    from ple_tools.table_layout import Layout

    gathering = arm_list(args)
    num_rows = table_rows(args)
    ensure_table(args.table, rows=num_rows, row_bytes=args.row_bytes, shards=args.shards,
                 files=args.files)
    layout = Layout.open(args.table, PREFIX)
    requests = make_requests(num_rows, args.calls, args.rows, args.seed)
    ceilings = [f"ceiling:{int(d)}" for d in (args.ceiling or "").split(",") if d.strip()]
    plan = [(arm, "cold") for arm in gathering + ceilings]
    if args.prime:
        plan.insert(0, (f"prime:{ceilings[0].partition(':')[2] if ceilings else 32}", "cold"))
    new_pages = new_pages_per_call(layout, requests, args.drop)
    if args.warm:
        plan += [(arm, "warm") for arm in gathering + ["numpy"]]

    setup = (f"{layout.num_rows:,} rows of {args.row_bytes} B "
             f"({layout.num_rows * args.row_bytes / 2**30:.2f} GiB) in {len(layout.shard_rows)} "
             f"shards over {len(layout.paths)} files; {args.calls} calls of {args.rows:,} random "
             f"ids per arm (seed {args.seed}); cold = page cache dropped before each {args.drop}")
    if pressure:
        setup += (f"; each arm in a child in a memory cgroup of {args.memory_limit} MiB with "
                  f"{args.ballast} MiB of touched ballast")
    if args.cpu_load:
        setup += f"; {args.cpu_load} busy processes on {os.cpu_count()} CPUs"
    print(setup, file=sys.stderr)

    # Other jobs on a shared machine load its CPUs as --cpu-load does: say how much.
    load_before = os.getloadavg()[0]
    results: list[dict] = []
    table = None
    if not pressure:
        table = ple.Table.from_safetensors(args.table, PREFIX)
    try:
        with BusyProcesses(args.cpu_load):
            run_plan(args, plan, layout, requests, new_pages, table, pressure, results)
    finally:
        if table is not None:
            table.close()

    load = (load_before, os.getloadavg()[0])
    print()
    print(setup)
    print(f"load average (1 min) {load[0]:.2f} before the arms, {load[1]:.2f} after "
          f"(--cpu-load's processes included)")
    report.print_cgroup_room(results)
    report.print_table(results)

    digests = {r["sha256"] for r in results if r.get("sha256")}
    failed = [r for r in results if "error" in r]
    print()
    if len(digests) == 1:
        print(f"every gathering arm returned the same bytes (sha256 {next(iter(digests))})")
    elif digests:
        print("FAIL: gathering arms returned different bytes:")
        for r in results:
            if r.get("sha256"):
                print(f"  {r['arm']:<14} {r['state']:<5} {r['sha256']}")
    cold_reads = [r for r in results if r.get("state") == "cold" and "error" not in r]
    if cold_reads and all(r["read_bytes_per_call"] == 0 for r in cold_reads):
        print("note: the cold arms read nothing from disk: the page cache could not be dropped "
              "(a tmpfs, or an overlay without a block device?)")

    found = report.ratios(results)
    report.print_ratios(found)

    # The command, its settings, the machine and the date: run_recorded records them.
    document = {"setup": setup,
                "table": {"num_rows": layout.num_rows, "row_bytes": args.row_bytes,
                          "files": [str(p) for p in layout.paths],
                          "shard_rows": layout.shard_rows},
                "load_average_1min": {"before_arms": load[0], "after_arms": load[1]},
                "arms": results, "ratios": found, "sha256_equal": len(digests) == 1,
                "failed_arms": [r["arm"] for r in failed]}
    if args.plot:
        report.plot(results, args.plot, setup.split(";")[0])
    if failed:
        print(f"FAIL: {len(failed)} arm(s) failed", file=sys.stderr)
        return 1, document
    return (0 if len(digests) <= 1 else 1), document


if __name__ == "__main__":
    sys.exit(main())
