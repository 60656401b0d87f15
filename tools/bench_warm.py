"""Times warm gathers of random rows (every page of the table in the page
cache) next to a floor: the same rows copied by a small C++ program outside
ple (tools/floor_gather.cpp, compiled now with the system's C++ compiler),
whose threads each copy a contiguous slice of the request in request order
with a software prefetch.

    ple-bench-warm [--table-gib 1] [--rows 32768,16] [--calls 50] [--threads 16]
                   [--python PATH ...] [--turns 3] [--json PATH]
    (or python tools/bench_warm.py ...)

Every call of a request size gathers other seeded random ids (the same ones
for ple and the floor), into one output buffer faulted in before.  Before its
timed calls, each arm runs them all once untimed.  The floor shares a
request among as many threads as ple does: --threads, but at least 256 ids
each (one thread for 16 ids).  The arms take turns:
ple, then the floor, --turns times, each in a child process; with --python
given (say, the interpreters of two virtual environments holding two builds
of ple) every turn runs ple under each of them in turn.  The tool reports, per
arm and request size, the median of all timed calls, the range of the turns'
medians, and for ple the median of the native gather's own time (gather_ns);
it checks that every arm's last call returned the same bytes, and exits
non-zero when they differ or an arm fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOOR_SOURCE = Path(__file__).resolve().with_name("floor_gather.cpp")
FLOOR = "floor"
CHILD = "--child"  # the first argument of ple's arm, run in a child process
ROWS_PER_THREAD = 256  # the gather's kMinRowsPerThread (kernels/row_gather.cpp)


def parse_args(argv=None) -> argparse.Namespace:
    from ple_tools.argtypes import (gather_threads, policy_spec, positive_float, positive_int,
                                    positive_int_list, refuse_empty_table,
                                    refuse_missing_program, refuse_over_memory, seed)
    from ple_tools.figures import add_json_option
    from ple_tools.make_table import refuse_table

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, default=Path("data/bench_warm_table"),
                        help="the table's directory: reused if ple wrote a table of this size "
                        "there, else written there; a directory holding files ple did not "
                        "write is refused (default data/bench_warm_table)")
    parser.add_argument("--table-gib", type=positive_float, default=1.0,
                        help="table size in GiB (default 1)")
    parser.add_argument("--row-bytes", type=positive_int, default=160,
                        help="bytes per row (default 160)")
    parser.add_argument("--rows", type=positive_int_list, default="32768,16",
                        help="ids per call, comma separated: one measurement each (default 32768,16)")
    parser.add_argument("--calls", type=positive_int, default=50,
                        help="timed calls per arm and turn (default 50)")
    parser.add_argument("--threads", type=gather_threads, default=16,
                        help="GatherConfig.threads, and the floor's threads (default 16)")
    parser.add_argument("--policy", type=policy_spec, default="window",
                        help="the gather's policy spec, as GatherConfig.from_spec takes it "
                        "(default window)")
    parser.add_argument("--python", action="append", metavar="PATH",
                        help="an interpreter whose ple to measure (repeat for several; default "
                        "this one)")
    parser.add_argument("--turns", type=positive_int, default=3,
                        help="turns of every arm (default 3)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the ids (default 0)")
    parser.add_argument("--cxx", default=os.environ.get("CXX", "c++"),
                        help="the C++ compiler for the floor (default $CXX, else c++)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    refuse_empty_table(parser, "--table-gib", args.table_gib * 2**30, args.row_bytes)
    for python in args.python or []:
        refuse_missing_program(parser, "--python", python)
    refuse_missing_program(parser, "--cxx", args.cxx)
    # A size's ids, the floor's (file, offset) pairs and its output file,
    # and a call's rows.
    largest = max((int(s) for s in args.rows.split(",") if s.strip()), default=0)
    refuse_over_memory(parser, "--rows", args.calls * largest * 24 + largest * args.row_bytes,
                       f"{args.calls:,} calls of {largest:,} ids")
    refuse_table(parser, args.table, rows=int(args.table_gib * 2**30) // args.row_bytes,
                 row_bytes=args.row_bytes,
                 options={"directory": "--table", "size": "--table-gib"})
    return args


def child_main(spec: dict) -> None:
    """ple's arm in this interpreter: prints a JSON object of per-call times."""
    import numpy as np
    import torch

    import ple
    from ple_tools.make_table import PREFIX

    results = {"ple": ple.__file__, "sizes": {}}
    with ple.Table.from_safetensors(Path(spec["table"]), PREFIX) as table:
        table.config = ple.GatherConfig.from_spec(spec["policy"], threads=spec["threads"])
        for size, ids_path in spec["ids"].items():
            requests = [torch.from_numpy(ids) for ids in np.load(ids_path)]
            out = torch.ones((len(requests[0]), table.row_bytes), dtype=torch.uint8)
            for ids in requests:  # untimed: page tables, caches
                table.gather_bytes(ids, out=out)
            wall, native = [], []
            for ids in requests:
                before = table.stats()["gather_ns"]
                start = time.perf_counter()
                table.gather_bytes(ids, out=out)
                wall.append((time.perf_counter() - start) * 1e6)
                native.append((table.stats()["gather_ns"] - before) / 1e3)
            results["sizes"][size] = {"us": wall, "native_us": native,
                                      "sha256": hashlib.sha256(out.numpy().data).hexdigest()}
    print(json.dumps(results))


def compile_floor(cxx: str, directory: Path) -> Path:
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} for the floor (--cxx, or $CXX)")
    binary = directory / "floor_gather"
    subprocess.run([cxx, "-O2", "-std=c++17", "-pthread", "-o", str(binary), str(FLOOR_SOURCE)],
                   check=True)
    return binary


def run_floor(binary: Path, threads: int, row_bytes: int, rows: int, pairs: Path,
              paths: list[Path], work: Path) -> dict:
    out = work / f"floor_out_{rows}"
    proc = subprocess.run([str(binary), str(threads), str(row_bytes), str(rows), str(pairs),
                           str(out), *map(str, paths)], capture_output=True, text=True, check=True)
    return {"us": [float(x) for x in proc.stdout.split()],
            "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}


def run_ple(python: str, spec: dict) -> dict:
    proc = subprocess.run([python, str(Path(__file__).resolve()), CHILD, json.dumps(spec)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{python}: ple's arm failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(turns: list[list[float]]) -> dict:
    medians = [statistics.median(t) for t in turns]
    every = [x for t in turns for x in t]
    return {"median_us": statistics.median(every), "turn_medians_us": medians}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [CHILD]:
        # Runs under the interpreters of --python, whose ple_tools may be
        # another build's: this path imports only what every build has.
        child_main(json.loads(argv[1]))
        return 0
    from ple_tools.figures import run_recorded

    args = parse_args(argv)
    return run_recorded(args, "bench_warm", argv, lambda: run(args))


def run(args: argparse.Namespace) -> tuple[int, list[dict]]:
    import numpy as np

    from ple_tools.bench_gpu import read_whole_file
    from ple_tools.make_table import PREFIX, ensure_table
    from ple_tools.table_layout import Layout

    num_rows = int(args.table_gib * 2**30) // args.row_bytes
    ensure_table(args.table, rows=num_rows, row_bytes=args.row_bytes)
    layout = Layout.open(args.table, PREFIX)
    sizes = [int(s) for s in args.rows.split(",") if s.strip()]
    pythons = args.python or [sys.executable]
    arms = [f"ple@{p}" for p in pythons] + [FLOOR]
    times: dict = {(arm, size): [] for arm in arms for size in sizes}
    native: dict = {(arm, size): [] for arm in arms[:-1] for size in sizes}
    digests: dict = {}
    failed = []
    with tempfile.TemporaryDirectory(prefix="ple-bench-warm-") as tmp:
        work = Path(tmp)
        floor = compile_floor(args.cxx, work)
        rng = np.random.default_rng(args.seed)
        ids_files, pair_files = {}, {}
        for size in sizes:
            ids = rng.integers(0, layout.num_rows, (args.calls, size), dtype=np.int64)
            ids_files[str(size)] = str(work / f"ids_{size}.npy")
            np.save(ids_files[str(size)], ids)
            _, file, offset = layout.locate(ids.reshape(-1))
            pair_files[size] = work / f"rows_{size}.bin"
            np.stack([file, offset], axis=1).astype(np.int64).tofile(pair_files[size])
        for path in layout.paths:
            read_whole_file(path)
        spec = {"table": str(args.table), "policy": args.policy, "threads": args.threads,
                "ids": ids_files}
        print(f"{layout.num_rows:,} rows of {args.row_bytes} B ({args.table_gib:g} GiB, page cache "
              f"warm); {args.calls} calls per arm and turn, {args.turns} turns; {args.threads} "
              f"threads; policy {args.policy}")
        for turn in range(args.turns):
            for python, arm in zip(pythons, arms):
                print(f"  turn {turn + 1}: {arm} ...", file=sys.stderr, flush=True)
                try:
                    result = run_ple(python, spec)
                except RuntimeError as error:
                    print(f"  {error}", file=sys.stderr)
                    failed.append(arm)
                    continue
                for size in sizes:
                    got = result["sizes"][str(size)]
                    times[arm, size].append(got["us"])
                    native[arm, size].append(got["native_us"])
                    digests.setdefault(size, set()).add(got["sha256"])
            print(f"  turn {turn + 1}: {FLOOR} ...", file=sys.stderr, flush=True)
            for size in sizes:
                threads = max(1, min(args.threads, size // ROWS_PER_THREAD))
                got = run_floor(floor, threads, args.row_bytes, size, pair_files[size],
                                layout.paths, work)
                times[FLOOR, size].append(got["us"])
                digests.setdefault(size, set()).add(got["sha256"])

    rows = []
    print(f"\nwarm gathers: median of {args.calls} x {args.turns} calls (range of the turns' "
          f"medians); native = ple's gather_ns")
    print(f"{'arm':<48} {'ids':>7} {'median us':>10} {'turns':>17} {'native us':>10} {'x floor':>8}")
    for size in sizes:
        floor_median = summarize(times[FLOOR, size])["median_us"] if times[FLOOR, size] else None
        for arm in arms:
            if not times[arm, size]:
                continue
            s = summarize(times[arm, size])
            n = summarize(native[arm, size])["median_us"] if arm != FLOOR else None
            s.update(arm=arm, ids=size, native_median_us=n)
            rows.append(s)
            lo, hi = min(s["turn_medians_us"]), max(s["turn_medians_us"])
            ratio = f"{s['median_us'] / floor_median:.2f}" if floor_median else "-"
            print(f"{arm[-48:]:<48} {size:>7} {s['median_us']:>10.1f} {lo:>8.1f}..{hi:<8.1f} "
                  f"{'-' if n is None else f'{n:.1f}':>10} {ratio:>8}")
    differ = [size for size, found in digests.items() if len(found) > 1]
    for size in differ:
        print(f"FAIL: the arms returned different bytes for {size} ids")
    return (1 if differ or failed else 0), rows


if __name__ == "__main__":
    sys.exit(main())
