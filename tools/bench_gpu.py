"""Benchmarks torch.ops.ple.disk_gather on a GPU: 160 B FP8 rows decoded to
bfloat16, for a decode step (16 rows) and a 2,048-token prefill chunk of 16
heads (32,768 rows), warm and cold, and with the table placed in tiers.

    ple-bench-gpu [--mib 1024] [--calls 50]     (or python tools/bench_gpu.py ...)

Per case it prints the median time per call of the operator in eager mode
(staged rows read by the kernel over UVA, and copied to the device first),
replayed in a CUDA graph, its parts (host gather, host-to-device copy,
kernel), and a plain PyTorch baseline (NumPy fancy indexing of a memmap,
torch.from_numpy, .to("cuda"), decode in torch); then the pinned
host-to-device and device-to-device copy bandwidths.  Then the operator with
the table all on disk, in thirds (device, host, disk), all in pinned host
memory, and all on the device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations; imported after parsing
    import torch

ROW_BYTES = 160
SIZES = (16, 32768)


def median_us(fn, calls: int, before=None) -> float:
    """Median wall time of fn() followed by a device synchronize, in us."""
    import torch

    times = []
    for i in range(calls):
        if before is not None:
            before(i)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def device_us(fn, calls: int) -> float:
    """Median device time of fn() by CUDA events, in us."""
    import torch

    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bandwidth_gbs(src: torch.Tensor, dst: torch.Tensor, calls: int = 20) -> float:
    us = device_us(lambda: dst.copy_(src, non_blocking=True), calls)
    return src.numel() * src.element_size() / us / 1e3


def read_whole_file(path: Path) -> None:
    """Brings the whole file into the page cache."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


# Tier splits, as (device, host) fractions of the table; the rest is on disk.
TIER_SPLITS = {"disk": (0, 0), "thirds": (1 / 3, 1 / 3), "host": (0, 1), "device": (1, 0)}


def tier_rows(table, calls: int, gen: torch.Generator, device) -> list[dict]:
    """Median eager time of the operator (warm page cache) with each split
    of TIER_SPLITS placed, for each request size; the output must not change."""
    import torch

    results = []
    num_rows = table.num_rows
    requests = {n: [torch.randint(0, num_rows, (n,), generator=gen).to(device) for _ in range(calls)]
                for n in SIZES}
    expected = {n: torch.ops.ple.disk_gather(r[0], table.handle, torch.bfloat16)
                for n, r in requests.items()}
    for split, (device_part, host_part) in TIER_SPLITS.items():
        device_rows = int(num_rows * device_part)
        host_rows = min(int(num_rows * host_part), num_rows - device_rows)
        start = time.perf_counter()
        table.place(device_rows=device_rows, host_rows=host_rows, device=device,
                    progress=sys.stderr.isatty())
        row = {"split": split, "device_rows": device_rows, "host_rows": host_rows,
               "place_s": time.perf_counter() - start}
        for n, cuda_requests in requests.items():
            got = torch.ops.ple.disk_gather(cuda_requests[0], table.handle, torch.bfloat16)
            assert torch.equal(got.view(torch.int16), expected[n].view(torch.int16)), \
                f"split {split} changed the rows"
            row[f"{n}_us"] = median_us(
                lambda i: torch.ops.ple.disk_gather(cuda_requests[i], table.handle, torch.bfloat16),
                calls)
        results.append(row)
        print(f"  tiers {split} done", file=sys.stderr)
    table.place()
    return results


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, default=Path("data/gpu_bench_table"),
                        help="the table's directory; written there unless it already holds a "
                        "table of this size (default data/gpu_bench_table)")
    parser.add_argument("--mib", type=float, default=1024, help="table size in MiB (default 1024)")
    parser.add_argument("--calls", type=int, default=50,
                        help="timed calls per warm measurement (default 50)")
    parser.add_argument("--cold-calls", type=int, default=8,
                        help="timed calls per cold measurement, each after the table's pages "
                        "are dropped (default 8)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch

    import ple
    from ple.kernels.decode_triton import decode_rows_triton
    from ple.ops import disk_gather_cuda
    from ple.staging import PinnedBuffer
    from ple_tools.make_table import PREFIX, ensure_table
    from ple_tools.table_layout import shard_entries

    if not torch.cuda.is_available():
        print("ple-bench-gpu needs a CUDA device, and torch sees none", file=sys.stderr)
        return 2
    num_rows = int(args.mib * 2**20) // ROW_BYTES
    ensure_table(args.table, rows=num_rows, row_bytes=ROW_BYTES, shards=1, files=1)
    device = torch.device("cuda")
    with ple.Table.from_safetensors(args.table, PREFIX) as table:
        (shard,) = shard_entries(table)
        path = shard.path
        memmap = np.memmap(path, dtype=np.uint8, mode="r", offset=shard.offset,
                           shape=(num_rows, ROW_BYTES))
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; table {path} "
              f"({num_rows:,} rows of {ROW_BYTES} B)", file=sys.stderr)
        fmt, scale = table.row_format, table.scale
        gen = torch.Generator().manual_seed(0)
        results = []
        for state in ("warm", "cold"):
            if state == "warm":
                read_whole_file(path)
            calls = args.calls if state == "warm" else args.cold_calls
            drop = None if state == "warm" else (lambda i: table.drop_page_cache())
            for n in SIZES:
                requests = [torch.randint(0, num_rows, (n,), generator=gen) for _ in range(calls)]
                cuda_requests = [r.to(device) for r in requests]
                row = {"state": state, "rows": n}

                for variant, threshold in (("eager_uva_us", 1 << 62), ("eager_copy_us", -1)):
                    disk_gather_cuda.UVA_MAX_BYTES = threshold
                    torch.ops.ple.disk_gather(cuda_requests[0], table.handle, torch.bfloat16)
                    row[variant] = median_us(
                        lambda i: torch.ops.ple.disk_gather(cuda_requests[i], table.handle,
                                                            torch.bfloat16), calls, drop)
                disk_gather_cuda.UVA_MAX_BYTES = 1 << 20

                static_ids = cuda_requests[0].clone()
                torch.ops.ple.disk_gather(static_ids, table.handle, torch.bfloat16)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    torch.ops.ple.disk_gather(static_ids, table.handle, torch.bfloat16)

                def set_ids(i):
                    static_ids.copy_(cuda_requests[i])
                    if drop is not None:
                        drop(i)
                row["graph_us"] = median_us(lambda i: graph.replay(), calls, set_ids)

                pinned = PinnedBuffer(n * ROW_BYTES)
                staged = pinned.bytes[: n * ROW_BYTES].view(n, ROW_BYTES)
                before = table.stats()
                row["host_gather_us"] = median_us(
                    lambda i: table.gather_bytes(requests[i], out=staged), calls, drop)
                after = table.stats()
                row["native_us"] = (after["gather_ns"] - before["gather_ns"]) / calls / 1e3
                staged_dev = torch.empty_like(staged, device=device)
                row["h2d_us"] = device_us(lambda: staged_dev.copy_(staged, non_blocking=True), 20)
                out = torch.empty(n, table.cols, dtype=torch.bfloat16, device=device)
                decode_rows_triton(staged_dev, fmt, scale, out)
                row["kernel_us"] = device_us(lambda: decode_rows_triton(staged_dev, fmt, scale, out), 20)
                pinned.free()

                def baseline(i):
                    rows = torch.from_numpy(memmap[requests[i].numpy()]).to(device)
                    return (rows.view(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)

                expected = baseline(0)
                got = torch.ops.ple.disk_gather(cuda_requests[0], table.handle, torch.bfloat16)
                assert torch.equal(got, expected), "operator and baseline disagree"
                row["baseline_us"] = median_us(baseline, calls, drop)
                results.append(row)
                print(f"  {state} {n} rows done", file=sys.stderr)

        read_whole_file(path)  # the cold pass emptied the page cache
        tiers = tier_rows(table, args.calls, gen, device)

        big = 256 << 20
        host = PinnedBuffer(big)
        dev_a, dev_b = torch.empty(big, dtype=torch.uint8, device=device), torch.empty(
            big, dtype=torch.uint8, device=device)
        h2d = bandwidth_gbs(host.bytes, dev_a)
        d2d = bandwidth_gbs(dev_a, dev_b)
        host.free()

    cols = ("eager_uva_us", "eager_copy_us", "graph_us", "host_gather_us", "native_us",
            "h2d_us", "kernel_us", "baseline_us")
    print(f"threads={table.config.threads}")
    print(f"{'state':<5} {'rows':>6} " + " ".join(f"{c:>15}" for c in cols) + f" {'speedup':>8}")
    for r in results:
        best = min(r["eager_uva_us"], r["eager_copy_us"])
        print(f"{r['state']:<5} {r['rows']:>6} " + " ".join(f"{r[c]:>15.1f}" for c in cols)
              + f" {r['baseline_us'] / best:>7.1f}x")
    print("native_us: mean time inside the native gather (host_gather_us less Python)")
    print(f"\ntiers (warm, eager, median us): {'split':<7} {'device_rows':>12} {'host_rows':>12} "
          f"{'place_s':>8} " + " ".join(f"{n:>9}" for n in SIZES))
    for r in tiers:
        print(f"{'':<30} {r['split']:<7} {r['device_rows']:>12,} {r['host_rows']:>12,} "
              f"{r['place_s']:>8.1f} " + " ".join(f"{r[f'{n}_us']:>9.1f}" for n in SIZES))
    print(f"\npinned host-to-device copy: {h2d:.1f} GB/s; device-to-device copy: {d2d:.1f} GB/s "
          f"(ratio {d2d / h2d:.1f}); speedup = baseline / best eager")
    return 0


if __name__ == "__main__":
    sys.exit(main())
