"""Benchmarks a table split by rows across the ranks of a process group, one
process per GPU over NCCL: per rank, the median time of a decode step (16
rows) and of a prefill chunk (32,768 rows) of 160 B FP8 rows decoded to
bfloat16, disk only and with the rank's own rows in its tiers, against one
process on one GPU serving the whole table.

    ple-bench-tensor-parallel [--world-size N] [--mib 1024] [--calls 30] [--json PATH]
                              (or python tools/bench_tensor_parallel.py ...)

Every rank gathers all of a step's ids, as the ranks of a tensor-parallel
model do (``ple.layers.parallel``: its own rows, the others' masked, and an
all_reduce that sums the shares), through a DiskEmbedding with
``process_group=``.  A call is timed from a barrier to the device
synchronize after it, the disk-only and the tiered table by turns (two
tables over the same file).  The tiered table keeps the fractions
``--tiers`` of the rows a process serves on its GPU and in page-locked host
memory (the one-GPU process: of the whole table, so that both hold the same
share of it).  The file stays in the page cache (warm).

The ranks run with NCCL_NVLS_ENABLE=0: NVLink multicast stays off.
``--backend gloo`` lets several ranks share a GPU (a dry run on one GPU),
and ``--device cpu`` runs it all on the CPU over gloo (host tier only), a
smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ple_tools.argtypes import (fraction_pair, non_negative_int, positive_float, positive_int,
                                refuse_empty_table, refuse_over_memory, seconds)
from ple_tools.figures import add_json_option, run_recorded
from ple_tools.make_table import refuse_table

ROW_BYTES = 160
SIZES = (16, 32768)  # a decode step, a prefill chunk (2,048 tokens of 16 heads)
ARMS = ("disk", "tiers")
# What a rank's process takes besides the table: Python, torch, the process group.
RANK_BYTES = 512 << 20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, default=Path("data/tp_bench_table"),
                        help="the table's directory: reused if ple wrote a table of this size "
                        "there, else written there; a directory holding files ple did not "
                        "write is refused (default data/tp_bench_table)")
    parser.add_argument("--mib", type=positive_float, default=1024,
                        help="table size in MiB (default 1024)")
    parser.add_argument("--calls", type=positive_int, default=30,
                        help="timed calls per case and table (default 30)")
    parser.add_argument("--world-size", type=positive_int,
                        help="ranks, one process each (default: the GPU count; 2 on the CPU)")
    parser.add_argument("--backend", choices=("nccl", "gloo"),
                        help="the process group's backend (default: nccl on GPUs, gloo on the CPU)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the ranks run: GPU r for rank r (shared round robin when "
                        "there are fewer GPUs, gloo only), or all on the CPU (default cuda)")
    parser.add_argument("--tiers", type=fraction_pair, default=(0.5, 0.5), metavar="DEVICE,HOST",
                        help="fractions of each process's rows in its device and host tiers "
                        "(default 0.5,0.5: all of them; on the CPU the host tier alone)")
    parser.add_argument("--timeout", type=seconds, default=600,
                        help="seconds the ranks of one run may take, in all (default 600)")
    add_json_option(parser)
    # One rank's part, run by the launcher.
    parser.add_argument("--rank", type=non_negative_int, help=argparse.SUPPRESS)
    parser.add_argument("--init-method", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.backend == "nccl":
        parser.error("--device cpu runs over gloo; NCCL needs GPUs")
    refuse_empty_table(parser, "--mib", args.mib * 2**20, ROW_BYTES)
    if args.rank is None:
        refuse_launch(parser, args)
    return args


def refuse_launch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The launcher's checks: the table, the ranks' processes, and the GPUs
    they take."""
    refuse_table(parser, args.table, rows=int(args.mib * 2**20) // ROW_BYTES, row_bytes=ROW_BYTES,
                 shards=1, files=1, options={"directory": "--table", "size": "--mib"})
    if args.world_size is not None:
        refuse_over_memory(parser, "--world-size", args.world_size * RANK_BYTES,
                           f"{args.world_size:,} ranks (a process with torch each)")
    if args.device != "cuda":
        return
    import torch  # the arguments are good so far

    gpus = torch.cuda.device_count()
    if not gpus:
        parser.error(f"argument --device: cuda, and torch {torch.__version__} sees no CUDA "
                     "device (--device cpu runs on the CPU)")
    if (args.backend or "nccl") == "nccl" and (args.world_size or gpus) > gpus:
        parser.error(f"argument --world-size: NCCL takes one GPU per rank, and {args.world_size} "
                     f"ranks are more than the {gpus} GPUs (--backend gloo shares them)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        return run_rank(args)
    return run_recorded(args, "bench_tensor_parallel", argv, lambda: launch(args))


def launch(args: argparse.Namespace) -> tuple[int, dict | None]:
    """Writes the table, runs one process unsplit, then the ranks, and reports."""
    import torch

    from ple_tools.bench_gpu import read_whole_file
    from ple_tools.make_table import ensure_table
    from ple_tools.ranks import run_ranks

    on_gpu = args.device == "cuda"
    gpus = torch.cuda.device_count() if on_gpu else 0
    world_size = args.world_size or (gpus if on_gpu else 2)
    backend = args.backend or ("nccl" if on_gpu else "gloo")
    num_rows = int(args.mib * 2**20) // ROW_BYTES
    ensure_table(args.table, rows=num_rows, row_bytes=ROW_BYTES, shards=1, files=1)
    for path in sorted(args.table.glob("*.safetensors")):
        read_whole_file(path)
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off
    runs = {}
    with tempfile.TemporaryDirectory(prefix="ple-bench-tp-") as scratch:
        for name, ranks in (("one", 1), ("split", world_size)):
            out = Path(scratch, name)
            command = [sys.executable, str(Path(__file__).resolve()), "--table", str(args.table),
                       "--mib", str(args.mib), "--calls", str(args.calls), "--device", args.device,
                       "--backend", backend, "--tiers", ",".join(map(str, args.tiers)),
                       "--world-size", str(ranks), "--init-method", f"file://{out / 'store'}",
                       "--out", str(out)]
            run = run_ranks([[*command, "--rank", str(rank)] for rank in range(ranks)],
                            args.timeout, out / "logs", env)
            if not run.ok:
                print(run.describe(), file=sys.stderr)
                return 1, None
            runs[name] = [json.loads((out / f"rank{rank}.json").read_text())
                          for rank in range(ranks)]
    report(runs, backend, num_rows)
    return 0, {"backend": backend, "world_size": world_size, "table_rows": num_rows,
               "row_bytes": ROW_BYTES, "one_process": runs["one"][0], "ranks": runs["split"]}


def run_rank(args: argparse.Namespace) -> int:
    """One process: the two tables (split when there are several ranks), the
    cases timed, its figures written to ``OUT/rank{RANK}.json``."""
    import torch
    import torch.distributed as dist

    from ple.layers import DiskEmbedding
    from ple_tools.bench_gpu import by_turns
    from ple_tools.make_table import PREFIX

    on_gpu = args.device == "cuda"
    device = (torch.device("cuda", args.rank % torch.cuda.device_count()) if on_gpu
              else torch.device("cpu"))
    if on_gpu:
        torch.cuda.set_device(device)
    group = None
    if args.world_size > 1:
        dist.init_process_group(args.backend, init_method=args.init_method, rank=args.rank,
                                world_size=args.world_size,
                                **({"device_id": device} if args.backend == "nccl" else {}))
        group = dist.group.WORLD
    try:
        tables = {arm: DiskEmbedding.from_safetensors(args.table, PREFIX, dtype=torch.bfloat16,
                                                      process_group=group) for arm in ARMS}
        start, stop = tables["tiers"].served_rows
        device_share, host_share = args.tiers
        device_rows = int((stop - start) * device_share) if on_gpu else 0
        host_rows = min(int((stop - start) * host_share), stop - start - device_rows)
        tables["tiers"].place(device_rows, host_rows, device if device_rows else None)
        sync = torch.cuda.synchronize if on_gpu else (lambda: None)
        barrier = (lambda i, arm: dist.barrier()) if group is not None else None
        generator = torch.Generator().manual_seed(0)  # the same ids on every rank
        cases = []
        for rows in SIZES:
            # Each arm its own ids (by_turns), the same on every rank.
            requests = {arm: [torch.randint(0, tables["disk"].num_embeddings, (rows,),
                                            generator=generator).to(device)
                              for _ in range(args.calls)] for arm in ARMS}
            # Warmed up (kernels, staging, the communicator) and checked: both
            # tables give the same rows.
            first = requests[ARMS[0]][0]
            if not torch.equal(*(tables[arm](first) for arm in ARMS)):
                raise AssertionError("the tiered table's rows differ from the disk-only table's")
            medians = by_turns({arm: (lambda i, t=tables[arm], r=requests[arm]: t(r[i]))
                                for arm in ARMS}, args.calls, barrier, sync)
            cases.append({"rows": rows, **{f"{arm}_us": medians[arm] for arm in ARMS}})
        figures = {"rank": args.rank, "device": str(device), "served_rows": [start, stop],
                   "device_rows": device_rows, "host_rows": host_rows, "cases": cases}
        (args.out / f"rank{args.rank}.json").write_text(json.dumps(figures))
        for table in tables.values():
            table.close()
    finally:
        if group is not None:
            dist.destroy_process_group()
    return 0


def report(runs: dict, backend: str, num_rows: int) -> None:
    one, ranks = runs["one"][0], runs["split"]
    print(f"table of {num_rows:,} rows of {ROW_BYTES} B (FP8 -> bfloat16), warm; one process "
          f"on {one['device']} vs {len(ranks)} ranks over {backend} on "
          f"{', '.join(r['device'] for r in ranks)}")
    print("tiers: " + "; ".join(f"{who} rows [{r['served_rows'][0]:,}, {r['served_rows'][1]:,}), "
                                f"{r['device_rows']:,} on device, {r['host_rows']:,} on host"
                                for who, r in [("one", one), *((f"rank {r['rank']}", r) for r in ranks)]))
    headings = [f"rank {r['rank']} us" for r in ranks]
    print(f"{'rows':>6} {'table':<6} {'one proc us':>11} " + " ".join(f"{h:>10}" for h in headings))
    for i, rows in enumerate(SIZES):
        for arm in ARMS:
            print(f"{rows:>6} {arm:<6} {one['cases'][i][f'{arm}_us']:>11.1f} " +
                  " ".join(f"{r['cases'][i][f'{arm}_us']:>10.1f}" for r in ranks))
    print("median us per call, from a barrier to the device synchronize after the all_reduce; "
          "every rank gathers all the ids")


if __name__ == "__main__":
    sys.exit(main())
