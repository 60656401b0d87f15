"""How the gather reads: prefetch policy, window and threads."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import ClassVar

POLICIES = ("window", "distance", "all", "none")


@dataclass(frozen=True)
class GatherConfig:
    """Settings of a table's gather.

    policy: "window" (default) keeps at most ``prefetch_window_kib`` of pages
        advised and not yet copied; "distance" advises pages less than
        ``prefetch_window_kib`` ahead of the copy address (the seed's rule);
        "all" advises every cold page first (the seed's old operator);
        "none" never advises.
    prefetch_window_kib: the window; 0 means no advice at all.
    threads: a request of at least 256 rows per thread is split by address
        range over up to this many threads, which share the window.
        Default: the machine's CPUs, at most 16.
    row_cache_mib: a host cache of recently gathered disk-tier rows, in
        front of the disk, holding at most this many MiB; 0 (default) is off.
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
        for name, least in (("prefetch_window_kib", 0), ("threads", 1), ("row_cache_mib", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if value < least:
                raise ValueError(f"{name} must be at least {least}, got {value}")

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
