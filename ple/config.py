"""How the gather reads: prefetch policy, window and threads."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import ClassVar

POLICIES = ("window", "distance", "all", "none")

# The most threads one gather runs on.  The gather's threads live for the whole
# process (the worker pool keeps every thread it has started), and past the
# machine's CPUs more threads only contend; 256 is more than the CPUs of most
# hosts this runs on, and bounds what a wrong value can start.
MAX_THREADS = 256
# The largest window: 2**40 KiB (1 PiB, 2**50 bytes).  The native gather
# counts the window in bytes in uint64 and adds it to mapped addresses (below
# 2**57 on every 64-bit Linux), which cannot wrap below 2**63; no page cache
# comes near it.
MAX_PREFETCH_WINDOW_KIB = 1 << 40
# The largest row cache budget: 2**40 MiB (1 EiB, 2**60 bytes), a factor 8
# below int64's limit for the native side's byte counts (``row_cache_mib << 20``
# as uint64, slots = bytes / row_bytes in int64).  A budget that the machine
# cannot map fails when it is set, with MemoryError (see Tiers in the README).
MAX_ROW_CACHE_MIB = 1 << 40
# Each int field's allowed range, both ends included.
RANGES = {"prefetch_window_kib": (0, MAX_PREFETCH_WINDOW_KIB), "threads": (1, MAX_THREADS),
          "row_cache_mib": (0, MAX_ROW_CACHE_MIB)}


@dataclass(frozen=True)
class GatherConfig:
    """Settings of a table's gather.

    policy: "window" (default) keeps at most ``prefetch_window_kib`` of pages
        advised and not yet copied; "distance" advises pages less than
        ``prefetch_window_kib`` ahead of the copy address (the seed's rule);
        "all" advises every cold page first (the seed's old operator);
        "none" never advises.
    prefetch_window_kib: the window; 0 means no advice at all; at most
        ``MAX_PREFETCH_WINDOW_KIB`` (2**40).
    threads: a request of at least 256 rows per thread is split by address
        range over up to this many threads, which share the window.
        Default: the machine's CPUs, at most 16; at most ``MAX_THREADS`` (256).
    row_cache_mib: a host cache of recently gathered disk-tier rows, in
        front of the disk, holding at most this many MiB; 0 (default) is off;
        at most ``MAX_ROW_CACHE_MIB`` (2**40).

    A field of the wrong type or outside its range is a ValueError naming
    the field, the value and the range (``RANGES``).
    """

    policy: str = "window"
    prefetch_window_kib: int = 4096
    threads: int = field(default_factory=lambda: min(16, os.cpu_count() or 1))
    row_cache_mib: int = 0

    # Fields that change how rows are read but never which bytes come back.
    IO_ONLY_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"policy", "prefetch_window_kib", "threads", "row_cache_mib"})

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown prefetch policy {self.policy!r}; expected one of {POLICIES}")
        for name, (least, most) in RANGES.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int in [{least}, {most}], got {value!r}")
            if not least <= value <= most:
                bound = f"at least {least}" if value < least else f"at most {most}"
                raise ValueError(f"{name} must be {bound}, got {value} (the range is "
                                 f"[{least}, {most}])")

    @classmethod
    def from_spec(cls, spec: str, **fields) -> "GatherConfig":
        """A config from ``"policy"`` or ``"policy:KiB"`` (the benchmarks'
        arm names, e.g. ``"window:4096"``); other fields as keywords."""
        policy, _, kib = spec.partition(":")
        if kib and not kib.isdigit():
            raise ValueError(f"bad gather spec {spec!r}: expected policy or policy:KiB")
        if kib:
            fields["prefetch_window_kib"] = int(kib)
        return cls(policy=policy, **fields)

    def compute_hash(self) -> str:
        """A hash of the fields that can change results (none of the I/O fields),
        for callers that key compiled artifacts or caches on the config."""
        result_fields = {k: v for k, v in asdict(self).items() if k not in self.IO_ONLY_FIELDS}
        return hashlib.sha256(json.dumps(result_fields, sort_keys=True).encode()).hexdigest()
