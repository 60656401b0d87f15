"""The gather benchmark's report: per-arm summaries of the calls, the table
printed, ratios between arms, the page cache room under a memory limit, and the
plot.  Figures and ratios only: what is good enough is
for the reader to judge."""

from __future__ import annotations

import mmap
import statistics
import sys
from pathlib import Path

PAGE = mmap.PAGESIZE
MiB = 2**20


def summarize(record: dict, rows: int, new_pages: list[int]) -> dict:
    calls = record.pop("calls")
    if record["state"] == "cold":
        for call, new in zip(calls, new_pages):
            call["new_pages"] = new
    n = len(calls)
    ms = [c["ms"] for c in calls]

    def mean(key):
        values = [c[key] for c in calls if c.get(key) is not None]
        return sum(values) / len(values) if values else None

    unique = mean("unique_pages")
    read = mean("read_bytes")
    cpu = mean("cpu_ms")
    record.update({
        "cpu_ms_per_call": cpu,
        # CPU per page the call asked for (every one read, cold with O_DIRECT)
        "cpu_us_per_page": cpu * 1e3 / unique if cpu is not None and unique else None,
        "direct_reads_per_call": mean("direct_reads"),
        "ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
        "rows_per_s": rows * n / (sum(ms) / 1e3),
        "unique_pages_per_call": unique,
        "unique_bytes_per_call": unique * PAGE,
        "new_pages_per_call": mean("new_pages"),
        "read_bytes_per_call": read,
        "read_over_unique": read / (unique * PAGE) if unique else None,
        "major_faults_per_call": mean("major_faults"),
        "advised_pages_per_call": mean("advised_pages"),
        "evicted_before_copy_per_call": mean("evicted_before_copy"),
        "resident_pages_per_call": mean("resident_pages"),
        "per_call": calls,
    })
    return record


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_table(results: list[dict]) -> None:
    header = (f"{'arm':<17} {'state':<5} {'median ms':>10} {'min ms':>9} {'max ms':>9} "
              f"{'cpu ms':>8} {'cpu us/pg':>9} "
              f"{'rows/s':>11} {'pages':>7} {'new':>7} {'read MiB':>9} {'read/uniq':>9} {'maj.flt':>8} "
              f"{'advised':>8} {'evicted':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['arm']:<17} {r['state']:<5} FAILED: {r['error']}")
            continue
        print(f"{r['arm']:<17} {r['state']:<5} {r['ms_median']:>10.2f} {r['ms_min']:>9.2f} "
              f"{r['ms_max']:>9.2f} {fmt(r['cpu_ms_per_call'], '>8.1f')} "
              f"{fmt(r['cpu_us_per_page'], '>9.2f')} {r['rows_per_s']:>11,.0f} "
              f"{r['unique_pages_per_call']:>7.0f} {fmt(r['new_pages_per_call'], '>7.0f')} "
              f"{r['read_bytes_per_call'] / MiB:>9.1f} "
              f"{fmt(r['read_over_unique'], '>8.2f')}x {fmt(r['major_faults_per_call'], '>8.0f')} "
              f"{fmt(r['advised_pages_per_call'], '>8.0f')} "
              f"{fmt(r['evicted_before_copy_per_call'], '>8.0f')}")


def ratios(results: list[dict]) -> dict:
    """Ratios of median times between the arms of one run, where both ran.
    Per gathering arm: cold, its time over the fastest O_DIRECT ceiling's,
    none's time over its (the speedup over no advice) and, under a memory
    limit, its time over all's; warm, NumPy's time over its.  Per direct arm,
    in either state, its time over the default window arm's (window:4096) in
    that state and, cold, its CPU per page over that ceiling's.  Returns
    {"reference": the arms compared with and their median ms, "arms": [...]}."""
    ok = [r for r in results if "error" not in r]
    get = {(r["arm"], r["state"]): r for r in ok}
    ceilings = [r for r in ok if r["arm"].startswith("ceiling:")]
    best = min(ceilings, key=lambda r: r["ms_median"]) if ceilings else None
    none, old, numpy_arm = get.get(("none", "cold")), get.get(("all", "cold")), get.get(("numpy", "warm"))
    pressure = any("cgroup" in r for r in ok)
    best_cpu = best and best.get("cpu_us_per_page")
    reference = {"ceiling": best and best["arm"], "ceiling_ms": best and best["ms_median"],
                 "ceiling_cpu_us_per_page": best_cpu,
                 "none_ms": none and none["ms_median"], "all_ms": old and old["ms_median"],
                 "numpy_ms": numpy_arm and numpy_arm["ms_median"], "pressure": pressure,
                 "window": WINDOW_ARM}
    arms = []
    for r in ok:
        if not r.get("sha256") or r is numpy_arm:
            continue
        ms = r["ms_median"]
        cold = r["state"] == "cold"
        direct = r["arm"].startswith("direct")
        window = get.get((WINDOW_ARM, r["state"]))
        arms.append({
            "time_over_window": ms / window["ms_median"] if direct and window else None,
            "cpu_page_over_ceiling": r["cpu_us_per_page"] / best_cpu
            if direct and cold and best_cpu and r.get("cpu_us_per_page") else None,
            "arm": r["arm"], "state": r["state"],
            "time_over_ceiling": ms / best["ms_median"] if cold and best else None,
            "none_over_time": none["ms_median"] / ms if cold and none and r is not none else None,
            "time_over_all": ms / old["ms_median"] if cold and pressure and old and r is not old
            else None,
            "numpy_over_time": numpy_arm["ms_median"] / ms if not cold and numpy_arm else None})
    return {"reference": reference, "arms": arms}


# The mmap gather the direct arms are compared with: the default config's.
WINDOW_ARM = "window:4096"

RATIO_COLUMNS = (("time_over_ceiling", "/ ceiling"), ("none_over_time", "none /"),
                 ("time_over_all", "/ all"), ("numpy_over_time", "numpy /"),
                 ("time_over_window", "/ window"), ("cpu_page_over_ceiling", "cpu/ceil"))


def print_ratios(found: dict) -> None:
    """The ratios as a table, the columns that have a figure only."""
    ref, arms = found["reference"], found["arms"]
    columns = [(key, title) for key, title in RATIO_COLUMNS
               if any(a[key] is not None for a in arms)]
    if not columns:
        return
    print("\nratios of median times:")
    if ref["ceiling"]:
        print(f"  / ceiling = the arm's over the fastest ceiling's ({ref['ceiling']}, "
              f"{ref['ceiling_ms']:.1f} ms)")
    if ref["none_ms"] is not None:
        print(f"  none /    = cold none's ({ref['none_ms']:.1f} ms) over the arm's")
    if ref["pressure"] and ref["all_ms"] is not None:
        print(f"  / all     = the arm's over cold all's ({ref['all_ms']:.1f} ms)")
    if ref["numpy_ms"] is not None:
        print(f"  numpy /   = warm numpy's ({ref['numpy_ms']:.2f} ms) over the arm's")
    if any(a["time_over_window"] is not None for a in arms):
        print(f"  / window  = a direct arm's over {ref['window']}'s in the same state")
    if any(a["cpu_page_over_ceiling"] is not None for a in arms):
        print(f"  cpu/ceil  = a direct arm's CPU per page over the ceiling's "
              f"({ref['ceiling_cpu_us_per_page']:.2f} us)")
    header = f"{'arm':<17} {'state':<5} " + " ".join(f"{title:>10}" for _, title in columns)
    print(header)
    print("-" * len(header))
    for a in arms:
        if any(a[key] is not None for key, _ in columns):
            print(f"{a['arm']:<17} {a['state']:<5} "
                  + " ".join(f"{fmt(a[key], '>9.2f', '        -')}{'x' if a[key] is not None else ' '}"
                             for key, _ in columns))


def print_cgroup_room(results: list[dict]) -> None:
    """Under a memory limit: the page cache room the limit left each kind of
    arm, and the kernel memory charged beside it."""
    for label, keep in (("gathering arms", True), ("ceiling arms", False)):
        rooms = [r["cgroup"] for r in results if "cgroup" in r and bool(r.get("sha256")) == keep]
        if rooms:
            room = [g["cache_room_bytes"] / MiB for g in rooms]
            other = [(g["usage_end"] - g["cache_end"] - g["anon_end"]) / MiB for g in rooms]
            print(f"{label}: page cache room left by the limit (limit - non-cache usage at "
                  f"the end of the arm) {min(room):.1f} to {max(room):.1f} MiB; kernel "
                  f"memory charged (page tables, slab) {min(other):.1f} to {max(other):.1f} MiB")


def plot(results: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed, no plot", file=sys.stderr)
        return
    ok = [r for r in results if "error" not in r]
    labels = [f"{r['arm']}\n{r['state']}" for r in ok]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, len(ok) * 0.9), 8), sharex=True)
    for x, r in enumerate(ok):
        ms = [c["ms"] for c in r["per_call"]]
        top.scatter([x] * len(ms), ms, s=10, alpha=0.6)
        top.hlines(r["ms_median"], x - 0.3, x + 0.3, color="black")
    top.set_ylabel("ms per call (median: bar)")
    top.set_yscale("log")
    top.set_title(title)
    xs = range(len(ok))
    bottom.bar(xs, [r["read_bytes_per_call"] / MiB for r in ok], label="read from disk")
    bottom.scatter(xs, [r["unique_bytes_per_call"] / MiB for r in ok], color="red", marker="_",
                   s=400, label="unique pages")
    bottom.set_ylabel("MiB read per call")
    bottom.legend()
    bottom.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}", file=sys.stderr)
