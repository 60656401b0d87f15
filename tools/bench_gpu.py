"""Benchmarks torch.ops.ple.disk_gather on a GPU: 160 B FP8 rows decoded to
bfloat16, for a decode step (16 rows) and a 2,048-token prefill chunk of 16
heads (32,768 rows), warm and cold, and with the table placed in tiers.

    ple-bench-gpu [--mib 1024] [--calls 50] [--json PATH]     (or python tools/bench_gpu.py ...)

Per case it prints the median time per call of the operator in eager mode
(staged rows read by the kernel over UVA, and copied to the device first),
replayed in a CUDA graph whose host gather is rung by a doorbell and by a
host node (by turns), its parts (the host gather alone, timed on the host,
host-to-device copy, kernel), and a plain PyTorch baseline (NumPy fancy
indexing of a memmap, torch.from_numpy, .to("cuda"), decode in torch).
Cold calls drop the table's pages first; the baseline's memmap is opened
for its own calls only, so that no other mapping keeps the pages.  Then:
a graph of one tiny kernel (the floor of a replay), the doorbell graph (as
it is, and with its thread kept spinning), the host-node graph and the tiny
kernel's graph replayed after pauses of 0, 20, 500 ms and 5 s (by turns),
with who answered the doorbell's rings and its thread's CPU time per
second of the pauses and of an idle second, the operator with the table
in tiers (eager, and 16 rows replayed in a CUDA graph), where the host time
of one small eager call goes, and the copy bandwidths.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import defaultdict
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ple_tools.argtypes import positive_float, positive_int, refuse_empty_table
from ple_tools.figures import add_json_option, run_recorded
from ple_tools.make_table import refuse_table

if TYPE_CHECKING:  # for annotations; imported after parsing
    import torch

ROW_BYTES = 160
SIZES = (16, 32768)


def median_us(fn, calls: int, before=None) -> float:
    """Median wall time of fn(i) followed by a device synchronize, in us;
    before(i), untimed, runs ahead of every call."""
    return by_turns({"fn": fn}, calls, before and (lambda i, name: before(i)))["fn"]


def by_turns(arms: dict, calls: int, before=None, sync=None) -> dict[str, float]:
    """Median wall time (us) of each arm's fn(i) and a device synchronize,
    the arms taking turns call by call, so that the machine's drift falls on
    all of them alike, and the arm that goes first rotates from call to
    call.  (Arms given the same ids would find rows that the arm before them
    left in the CPU's caches: give each its own.)  before(i, arm), untimed,
    runs ahead of every call.
    ``sync``: waits for the device (default torch.cuda.synchronize)."""
    import torch

    sync = sync or torch.cuda.synchronize
    times = {name: [] for name in arms}
    order = list(arms.items())
    for i in range(calls):
        turn = i % len(order)
        for name, fn in order[turn:] + order[:turn]:
            if before is not None:
                before(i, name)
            sync()
            start = time.perf_counter()
            fn(i)
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def host_us(fn, calls: int, before=None) -> float:
    """Median wall time of fn(i) on the host alone (no device synchronize), in us."""
    return by_turns({"fn": fn}, calls, before and (lambda i, name: before(i)),
                    sync=lambda: None)["fn"]


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


def capture(fn, mechanism: str | None = None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of fn(); ``mechanism`` ("host_func") sets how its host
    gathers run (PLE_GRAPH_GATHER, read at capture)."""
    import torch

    saved = os.environ.get("PLE_GRAPH_GATHER")
    if mechanism is not None:
        os.environ["PLE_GRAPH_GATHER"] = mechanism
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph
    finally:
        if saved is None:
            os.environ.pop("PLE_GRAPH_GATHER", None)
        else:
            os.environ["PLE_GRAPH_GATHER"] = saved


class Baseline:
    """The plain PyTorch way: NumPy fancy indexing of a memmap of the shard,
    torch.from_numpy, .to(device), decode in torch.  The memmap is opened
    (open(), untimed) for the baseline's own calls and closed after them
    (close()), so that it keeps no page of the table while the operator's
    cold calls run."""

    def __init__(self, path: Path, offset: int, num_rows: int, scale: float, device):
        self.args = (path, offset, num_rows)
        self.scale, self.device = scale, device
        self.memmap = None

    def open(self) -> None:
        import numpy as np

        if self.memmap is None:
            path, offset, num_rows = self.args
            self.memmap = np.memmap(path, dtype=np.uint8, mode="r", offset=offset,
                                    shape=(num_rows, ROW_BYTES))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        import torch

        rows = torch.from_numpy(self.memmap[ids.numpy()]).to(self.device)
        return (rows.view(torch.float8_e4m3fn).float() * self.scale).to(torch.bfloat16)

    def close(self) -> None:
        if self.memmap is not None:
            self.memmap._mmap.close()
            self.memmap = None


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
        row["graph_us"] = graph_with_tiers_us(table, requests[SIZES[0]], expected[SIZES[0]], calls)
        results.append(row)
        print(f"  tiers {split} done", file=sys.stderr)
    table.place()
    return results


def graph_with_tiers_us(table, requests: list, expected, calls: int) -> float:
    """Median replay of a CUDA graph of the operator over the tiers placed now
    (a graph keeps the tiers it captured), its ids set to each request in
    turn; its first replay must give the expected rows."""
    import torch

    static_ids = requests[0].clone()
    outputs = []
    graph = capture(lambda: outputs.append(
        torch.ops.ple.disk_gather(static_ids, table.handle, torch.bfloat16)))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outputs[-1].view(torch.int16), expected.view(torch.int16)), \
        "the graph over the tiers changed the rows"
    return median_us(lambda i: graph.replay(), calls, lambda i: static_ids.copy_(requests[i]))


def host_overhead(table, calls: int, gen: torch.Generator, device) -> dict[str, dict[str, float]]:
    """Where the host time of one eager call of SIZES[0] rows goes (median
    us, no device synchronize), with every row in the device tier and with
    none (from the page cache): the whole call through torch.ops, the same
    call without the dispatcher (ple's own Python and its launches), the
    decoder's launch alone (its arguments made beforehand), and, from the
    page cache, the host gather's enqueue alone (the ids' copy and the host
    function).  The table's tiers are dropped after."""
    import torch

    from ple.kernels.decode_triton import decode_rows_triton
    from ple.ops.disk_gather_cuda import disk_gather_cuda

    n, fmt, scale = SIZES[0], table.row_format, table.scale
    requests = [torch.randint(0, table.num_rows, (n,), generator=gen).to(device) for _ in range(calls)]
    out = torch.empty(n, table.cols, dtype=torch.bfloat16, device=device)
    staging = table.staging_for(torch.cuda.current_stream())
    result = {}
    for source, device_rows in (("device_tier", table.num_rows), ("page_cache", 0)):
        table.place(device_rows=device_rows, device=device)
        row = {"call_us": host_us(
            lambda i: torch.ops.ple.disk_gather(requests[i], table.handle, torch.bfloat16), calls),
            "ple_us": host_us(lambda i: disk_gather_cuda(table, requests[i], torch.bfloat16, scale),
                              calls)}
        handle, tiers = table.acquire()
        try:
            if tiers is not None:
                tier_read, status = tiers.read(requests[0], table.num_rows, None,
                                               staging.bad_id_word, False)
                row["launch_us"] = host_us(
                    lambda i: decode_rows_triton(None, fmt, scale, out, status, tier_read), calls)
            else:
                rows, status = staging.gather(handle, requests[0], (0, 0), False)
                row["launch_us"] = host_us(lambda i: decode_rows_triton(rows, fmt, scale, out, status),
                                           calls)
                row["host_gather_enqueue_us"] = host_us(
                    lambda i: staging.gather(handle, requests[i], (0, 0), False), calls)
            torch.cuda.synchronize()
        finally:
            table.release(tiers)
        result[source] = row
    table.place()
    tiny = torch.zeros(1, device=device)
    result["torch_launch_us"] = host_us(lambda i: tiny.add_(1), calls)
    torch.cuda.synchronize()
    return result


PAUSES_MS = (0, 20, 500, 5000)
DOORBELL_THREAD = "ple-doorbell"  # the doorbell thread's name (kernels/doorbell_gather.cpp)
# The goal of a doorbell replay after a pause: at most this times the host-node graph's.
PAUSE_GOAL = 1.2
# The seconds of pauses a pause row may take at most (rows of long pauses take
# fewer turns, 3 at least).
PAUSE_ROW_S = 30.0


def thread_cpu_ns(name: str) -> int | None:
    """CPU time so far of this process's threads called ``name``, in ns
    (/proc/self/task/*/schedstat; None where no thread has that name)."""
    found = None
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == name:
                found = (found or 0) + int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return found


def pause_turns(pause_ms: int, arms: int, calls: int) -> int:
    """Turns of a pause row: calls // 5 (5 at least), fewer where their
    pauses would take more than PAUSE_ROW_S, 3 at the least."""
    turns = max(5, calls // 5)
    if pause_ms:
        turns = min(turns, int(PAUSE_ROW_S / (pause_ms / 1e3 * arms)))
    return max(3, turns)


def pause_rows(graphs: dict, calls: int) -> dict[str, dict]:
    """Per pause of PAUSES_MS: each graph's median replay after it (the
    graphs by turns, each replay after its own pause), the doorbell
    thread's CPU time per second of the row's graphs but the spinning one
    (ms/s: at pause 0 while replays run back to back; after a pause the spin
    after a replay, and the checks of its sleep), and who answered the
    doorbell graph's rings (its wake-up node or the thread; the spinning
    one's are the thread's).  ``graphs``
    holds "doorbell" (replayed as it is, and as "doorbell_spinning" with the
    doorbell thread kept spinning through the pause: what is left of a
    replay's cost after a pause once nothing must wake), "host_func" and
    "tiny" (one kernel: what a pause costs the GPU and the driver alone)."""
    from ple.kernels.native import native

    arms = {name: (lambda i, g=g: g.replay()) for name, g in graphs.items()}
    arms["doorbell_spinning"] = arms["doorbell"]
    result = {}
    for pause in PAUSES_MS:
        # The thread's CPU, the seconds and who answered, from one arm's turn
        # to the next, by arm: a turn is its pause and its replay.
        cpu, seconds = defaultdict(int), defaultdict(float)
        answers = defaultdict(lambda: defaultdict(int))
        last = {"arm": None, "cpu": None, "at": 0.0, "counts": None, "spins": False}

        def account() -> None:
            now, used = time.perf_counter(), thread_cpu_ns(DOORBELL_THREAD)
            counts = native.doorbell_counts()
            if last["arm"] is not None:
                if None not in (used, last["cpu"]):
                    cpu[last["arm"]] += used - last["cpu"]
                seconds[last["arm"]] += now - last["at"]
                for key, value in counts.items():
                    answers[last["arm"]][key] += value - last["counts"][key]
            last.update(cpu=used, at=now, counts=counts)

        def before(i, name, pause=pause):
            account()
            last["arm"] = name
            spins = name == "doorbell_spinning"
            if spins != last["spins"]:
                native.set_doorbell_always_spins(spins)
                last["spins"] = spins
            time.sleep(pause / 1e3)

        try:
            replays = by_turns(arms, pause_turns(pause, len(arms), calls), before)
            account()
        finally:
            native.set_doorbell_always_spins(False)
        row = {f"{name}_us": us for name, us in replays.items()}
        row["doorbell_over_host_func"] = row["doorbell_us"] / row["host_func_us"]
        unspun = [arm for arm in seconds if arm != "doorbell_spinning"]
        row["doorbell_thread_cpu_ms_per_s"] = (
            sum(cpu[arm] for arm in unspun) / 1e6 / sum(seconds[arm] for arm in unspun)
            if unspun else None)
        row["answers"] = dict(answers["doorbell"])
        result[f"after_{pause}ms"] = row
    return result


def idle_cpu_ms_per_s(seconds: float = 1.0) -> float | None:
    """The doorbell thread's CPU time per second while no graph runs, over
    ``seconds`` from a moment after the last replay."""
    time.sleep(0.1)  # past the spin after the last replay
    cpu0 = thread_cpu_ns(DOORBELL_THREAD)
    time.sleep(seconds)
    cpu1 = thread_cpu_ns(DOORBELL_THREAD)
    return None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / 1e6 / seconds


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, default=Path("data/gpu_bench_table"),
                        help="the table's directory: reused if ple wrote a table of this size "
                        "there, else written there; a directory holding files ple did not "
                        "write is refused (default data/gpu_bench_table)")
    parser.add_argument("--mib", type=positive_float, default=1024,
                        help="table size in MiB (default 1024)")
    parser.add_argument("--calls", type=positive_int, default=50,
                        help="timed calls per warm measurement (default 50)")
    parser.add_argument("--cold-calls", type=positive_int, default=8,
                        help="timed calls per cold measurement, each after the table's pages "
                        "are dropped (default 8)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    refuse_empty_table(parser, "--mib", args.mib * 2**20, ROW_BYTES)
    refuse_table(parser, args.table, rows=int(args.mib * 2**20) // ROW_BYTES, row_bytes=ROW_BYTES,
                 shards=1, files=1, options={"directory": "--table", "size": "--mib"})
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_recorded(args, "bench_gpu", argv, lambda: run(args))


def run(args: argparse.Namespace) -> tuple[int, dict | None]:
    import torch

    import ple
    from ple.kernels.decode_triton import decode_rows_triton
    from ple.kernels.native import native
    from ple.ops import disk_gather_cuda
    from ple.staging import PinnedBuffer
    from ple_tools.make_table import PREFIX, ensure_table
    from ple_tools.table_layout import shard_entries

    if not torch.cuda.is_available():
        print("ple-bench-gpu needs a CUDA device, and torch sees none", file=sys.stderr)
        return 2, None
    num_rows = int(args.mib * 2**20) // ROW_BYTES
    ensure_table(args.table, rows=num_rows, row_bytes=ROW_BYTES, shards=1, files=1)
    device = torch.device("cuda")
    with ple.Table.from_safetensors(args.table, PREFIX) as table:
        (shard,) = shard_entries(table)
        path = shard.path
        # The CPUs, the GPU, torch and the settings: run_recorded records them.
        machine = {"threads": table.config.threads,
                   "graph_gather": native.graph_gather_mechanism(), "table_rows": num_rows,
                   "row_bytes": ROW_BYTES}
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; table {path} "
              f"({num_rows:,} rows of {ROW_BYTES} B)", file=sys.stderr)
        fmt, scale = table.row_format, table.scale
        baseline = Baseline(path, shard.offset, num_rows, scale, device)
        gen = torch.Generator().manual_seed(0)
        tiny = torch.zeros(1, device=device)
        floor_graph = capture(lambda: tiny.add_(1))
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
                graphs = {mechanism: capture(
                    lambda: torch.ops.ple.disk_gather(static_ids, table.handle, torch.bfloat16),
                    None if mechanism == "doorbell" else mechanism)
                    for mechanism in ("doorbell", "host_func")}

                # Each graph its own ids: the same ids right after the other
                # graph's would find their rows in the CPU's caches.
                graph_requests = {name: [torch.randint(0, num_rows, (n,), generator=gen).to(device)
                                         for _ in range(calls)] for name in graphs}

                def set_ids(i, name):
                    static_ids.copy_(graph_requests[name][i])
                    if drop is not None:
                        drop(i)
                replays = by_turns({name: (lambda i, g=g: g.replay()) for name, g in graphs.items()},
                                   calls, set_ids)
                row["graph_doorbell_us"], row["graph_host_func_us"] = (
                    replays["doorbell"], replays["host_func"])
                if state == "warm" and n == SIZES[0]:
                    machine["pauses"] = pause_rows({**graphs, "tiny": floor_graph}, calls)
                    machine["doorbell_idle_cpu_ms_per_s"] = idle_cpu_ms_per_s()
                del graphs

                pinned = PinnedBuffer(n * ROW_BYTES)
                staged = pinned.bytes[: n * ROW_BYTES].view(n, ROW_BYTES)
                before = table.stats()
                row["host_gather_us"] = host_us(
                    lambda i: table.gather_bytes(requests[i], out=staged), calls, drop)
                after = table.stats()
                row["native_us"] = (after["gather_ns"] - before["gather_ns"]) / calls / 1e3
                staged_dev = torch.empty_like(staged, device=device)
                row["h2d_us"] = device_us(lambda: staged_dev.copy_(staged, non_blocking=True), 20)
                out = torch.empty(n, table.cols, dtype=torch.bfloat16, device=device)
                decode_rows_triton(staged_dev, fmt, scale, out)
                row["kernel_us"] = device_us(lambda: decode_rows_triton(staged_dev, fmt, scale, out), 20)
                pinned.free()

                got = torch.ops.ple.disk_gather(cuda_requests[0], table.handle, torch.bfloat16)
                baseline.open()
                assert torch.equal(got, baseline(requests[0])), "operator and baseline disagree"

                def baseline_before(i):
                    # Cold: the baseline's mapping must not keep the dropped pages.
                    if drop is not None:
                        baseline.close()
                        drop(i)
                        baseline.open()
                row["baseline_us"] = median_us(lambda i: baseline(requests[i]), calls, baseline_before)
                baseline.close()
                results.append(row)
                print(f"  {state} {n} rows done", file=sys.stderr)

        machine["tiny_graph_us"] = median_us(lambda i: floor_graph.replay(), args.calls)
        read_whole_file(path)  # the cold pass emptied the page cache
        tiers = tier_rows(table, args.calls, gen, device)
        host = host_overhead(table, args.calls, gen, device)

        big = 256 << 20
        pinned = PinnedBuffer(big)
        dev_a, dev_b = torch.empty(big, dtype=torch.uint8, device=device), torch.empty(
            big, dtype=torch.uint8, device=device)
        machine["h2d_gbs"] = bandwidth_gbs(pinned.bytes, dev_a)
        machine["d2d_gbs"] = bandwidth_gbs(dev_a, dev_b)
        pinned.free()

    report(machine, results, tiers, host)
    return 0, {"machine": machine, "cases": results, "tiers": tiers, "host": host}


def pauses_lines(pauses: dict[str, dict], idle_cpu: float | None) -> list[str]:
    """The replays after each pause: the doorbell graph against the host-node
    graph (goal: at most PAUSE_GOAL times), the doorbell graph with its thread
    kept spinning, the one-kernel graph, the doorbell thread's CPU time and
    who answered the doorbell's rings."""
    def ms_per_s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    indent = " " * 2
    lines = ["16 warm rows in a graph, replayed after a pause (median us; by turns):",
             f"{indent}{'pause':>6} {'doorbell':>9} {'host node':>9} {'ratio':>6} "
             f"{'spinning':>9} {'one kernel':>10} {'thread CPU ms/s':>15} "
             f"{'by node':>7} {'by thread':>9}"]
    for key, row in pauses.items():
        answers = row.get("answers", {})
        lines.append(
            f"{indent}{key.removeprefix('after_'):>6} {row['doorbell_us']:>9.1f} "
            f"{row['host_func_us']:>9.1f} {row['doorbell_us'] / row['host_func_us']:>5.2f}x "
            f"{row['doorbell_spinning_us']:>9.1f} {row['tiny_us']:>10.1f} "
            f"{ms_per_s(row['doorbell_thread_cpu_ms_per_s']):>15} "
            f"{answers.get('by_node', '-'):>7} {answers.get('by_thread', '-'):>9}")
    lines.append(f"{indent}ratio: doorbell / host node (goal <= {PAUSE_GOAL:g}x after each pause); "
                 "spinning: the doorbell graph with its thread kept spinning through the pause; "
                 "thread CPU: the doorbell thread's over the row's turns but the spinning graph's (at 0ms "
                 "while replays run); "
                 "by node / by thread: who answered the doorbell graph's rings")
    lines.append(f"{indent}the doorbell thread idle for a second: {ms_per_s(idle_cpu)} ms/s of CPU "
                 "(goal <= 1)")
    return lines


def report(machine: dict, results: list[dict], tiers: list[dict], host: dict) -> None:
    cols = ("eager_uva_us", "eager_copy_us", "graph_doorbell_us", "graph_host_func_us",
            "host_gather_us", "native_us", "h2d_us", "kernel_us", "baseline_us")
    print(f"GatherConfig.threads={machine['threads']} (the CUDA operator's host gather runs on at "
          f"most the CPUs less one), graphs' host gather: {machine['graph_gather']}")
    print(f"{'state':<5} {'rows':>6} " + " ".join(f"{c:>18}" for c in cols) + f" {'speedup':>8}")
    for r in results:
        best = min(r["eager_uva_us"], r["eager_copy_us"])
        print(f"{r['state']:<5} {r['rows']:>6} " + " ".join(f"{r[c]:>18.1f}" for c in cols)
              + f" {r['baseline_us'] / best:>7.1f}x")
    print("graph_*: one replay, its host gather rung by a doorbell or run by a host node (by turns);\n"
          "host_gather_us: table.gather_bytes alone, timed on the host; native_us: the time "
          "inside the native gather")
    print(f"\na graph of one tiny kernel: {machine['tiny_graph_us']:.1f} us a replay (the floor)")
    print("\n".join(pauses_lines(machine["pauses"], machine["doorbell_idle_cpu_ms_per_s"])))
    print(f"\ntiers (warm, eager, median us): {'split':<7} {'device_rows':>12} {'host_rows':>12} "
          f"{'place_s':>8} " + " ".join(f"{n:>9}" for n in SIZES) + f" {'graph_' + str(SIZES[0]):>9}")
    for r in tiers:
        print(f"{'':<30} {r['split']:<7} {r['device_rows']:>12,} {r['host_rows']:>12,} "
              f"{r['place_s']:>8.1f} " + " ".join(f"{r[f'{n}_us']:>9.1f}" for n in SIZES)
              + f" {r['graph_us']:>9.1f}")
    print(f"{'':<30} graph_{SIZES[0]}: one replay of a CUDA graph captured with the split "
          "placed (the doorbell rings the host gather of rows not resident)")
    print(f"\nhost time of one eager call of {SIZES[0]} warm rows (median us, no sync; a torch "
          f"kernel launch: {host['torch_launch_us']:.1f}):")
    for source in ("device_tier", "page_cache"):
        r = host[source]
        enqueue = r.get("host_gather_enqueue_us")
        print(f"  {source:<11} call {r['call_us']:6.1f} = torch.ops dispatch "
              f"{r['call_us'] - r['ple_us']:5.1f} + ple {r['ple_us']:6.1f}, of which the decoder's "
              f"launch {r['launch_us']:5.1f}"
              + ("" if enqueue is None else f" and the host gather's enqueue {enqueue:5.1f}"))
    print(f"\npinned host-to-device copy: {machine['h2d_gbs']:.1f} GB/s; device-to-device copy: "
          f"{machine['d2d_gbs']:.1f} GB/s (ratio {machine['d2d_gbs'] / machine['h2d_gbs']:.1f}); "
          "speedup = baseline / best eager")


if __name__ == "__main__":
    sys.exit(main())
