"""How the gather reads: prefetch policy, window, threads, row cache, and
whether rows come through the page cache or with direct I/O.

The fields, their units, defaults and ranges, the policies and the io modes
are defined once, by the native part (``kernels/gather_config.h``), which
checks them too; this module takes them from it (``FIELDS``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from .kernels.native import native

# Each field of GatherConfig by name, in its order: "default", and "choices"
# and "what" they choose (policy, io) or "unit", "unit_bytes" (bytes per
# unit; 0 for a count), "least", "most" and "power_of_two" (the int fields).
FIELDS: dict[str, dict] = {entry["name"]: dict(entry) for entry in native.CONFIG_FIELDS}

# The policies, the default first.
POLICIES: tuple[str, ...] = tuple(FIELDS["policy"]["choices"])
# The io modes, the default ("mmap") first.
IO_MODES: tuple[str, ...] = tuple(FIELDS["io"]["choices"])
# The most threads one gather runs on (256): the gather's threads live for the
# whole process, and past the machine's CPUs more threads only contend.
MAX_THREADS: int = FIELDS["threads"]["most"]
# The largest window, 2**40 KiB (1 PiB): the native gather counts it in bytes.
MAX_PREFETCH_WINDOW_KIB: int = FIELDS["prefetch_window_kib"]["most"]
# The largest row cache budget, 2**40 MiB (2**60 bytes); a budget that the
# machine cannot map fails when it is set, with MemoryError.
MAX_ROW_CACHE_MIB: int = FIELDS["row_cache_mib"]["most"]
# Each int field's allowed range, both ends included (io_block_bytes is also
# 0 or a power of two).
RANGES: dict[str, tuple[int, int]] = {
    name: (entry["least"], entry["most"]) for name, entry in FIELDS.items() if "least" in entry}
# Each choice field's choices.
CHOICES: dict[str, tuple[str, ...]] = {
    name: tuple(entry["choices"]) for name, entry in FIELDS.items() if "choices" in entry}


def _default_threads() -> int:
    # The native default is a cap: the machine's CPUs, at most that many.
    return min(FIELDS["threads"]["default"], os.cpu_count() or 1)


@dataclass(frozen=True)
class GatherConfig:
    """Settings of a table's gather (``table.config = GatherConfig(...)``,
    applied from the next call).  Every field changes how rows are read,
    never which bytes come back.

    Attributes:
        policy: how pages are advised ahead of the copy (``POLICIES``):
            "window" (default) keeps at most ``prefetch_window_kib`` of pages
            advised and not yet copied; "distance" advises the pages less
            than ``prefetch_window_kib`` ahead of the copy address, however
            many those are; "all" advises every cold page of the request
            before copying (the plain way, to compare the others with);
            "none" never advises.
        prefetch_window_kib: the window, in KiB (default 4096); 0 means no
            advice at all; at most ``MAX_PREFETCH_WINDOW_KIB`` (2**40).
        threads: a request of at least 256 rows per thread is split by
            address range over up to this many threads, which share the
            window.  Default: the machine's CPUs, at most 16; at most
            ``MAX_THREADS`` (256).  The CUDA operator's host gather runs
            on at most the CPUs less one: the thread that waits for the
            stream spins on one.
        row_cache_mib: a host cache of recently gathered disk-tier rows, in
            front of the disk, holding at most this many MiB; 0 (default) is
            off; at most ``MAX_ROW_CACHE_MIB`` (2**40).  With ``io="direct"``
            it is the only cache: without it every gather reads the disk.
        io_queue_depth: with ``io="direct"``, the most reads in flight
            (default 64; 1 to 1024), shared by the gather's threads.
        io_block_bytes: with ``io="direct"``, the block that reads are
            made of: each distinct block under the rows is read once.  0
            (default) takes the smallest the files allow, their direct-I/O
            alignment (the device's logical block size: 512 B or 4 KiB);
            another value is a power of two up to 65536, and a block never
            smaller than that alignment.
        io: where the rows that no tier or row cache holds come from
            (``IO_MODES``): "mmap" (default) copies them out of the files'
            mappings, through the page cache, with ``policy``'s advice;
            "direct" reads their blocks with O_DIRECT (io_uring, else Linux
            AIO, else pread threads: ``Table.io_backend`` says which), no page
            cache, and ``policy`` and ``prefetch_window_kib`` do nothing.  A
            filesystem that refuses O_DIRECT makes assigning such a config an
            OSError naming the file.

    A field of the wrong type or outside its range is a ValueError naming
    the field, the value and the range (``RANGES``).
    """

    policy: str = FIELDS["policy"]["default"]
    prefetch_window_kib: int = FIELDS["prefetch_window_kib"]["default"]
    threads: int = field(default_factory=_default_threads)
    row_cache_mib: int = FIELDS["row_cache_mib"]["default"]
    io_queue_depth: int = FIELDS["io_queue_depth"]["default"]
    io_block_bytes: int = FIELDS["io_block_bytes"]["default"]
    io: str = FIELDS["io"]["default"]

    def __post_init__(self):
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"unknown {FIELDS[name]['what']} {getattr(self, name)!r}; "
                                 f"expected one of {choices}")
        for name, (least, most) in RANGES.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int in [{least}, {most}], got {value!r}")
            if not least <= value <= most:
                bound = f"at least {least}" if value < least else f"at most {most}"
                raise ValueError(f"{name} must be {bound}, got {value} (the range is "
                                 f"[{least}, {most}])")
            if FIELDS[name]["power_of_two"] and value & (value - 1):
                raise ValueError(f"{name} must be 0 or a power of two, got {value}")

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

    def _native_args(self) -> tuple:
        """The fields in order as the native ``configure`` takes them, the
        sizes in bytes (a value times its unit's bytes)."""
        def native_value(name: str):
            unit_bytes = FIELDS[name].get("unit_bytes", 0)
            return getattr(self, name) * unit_bytes if unit_bytes else getattr(self, name)

        return tuple(native_value(name) for name in FIELDS)


# The dataclass spells the field names out; they must be the native side's.
if [f.name for f in dataclasses.fields(GatherConfig)] != list(FIELDS):
    raise ImportError(f"ple.GatherConfig's fields {[f.name for f in dataclasses.fields(GatherConfig)]} "
                      f"are not the native part's {list(FIELDS)}: rebuild the native part")
