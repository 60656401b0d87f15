"""The counters of ``Table.stats()``: ``COUNTERS`` names each, in the order
``stats()`` returns them, with a line on what it counts.

The native gather's counters are defined once in ``kernels/counters.h`` (and
exported by the native part); the two tier counters are added by the tiers
(``ple/tiers.py``; on CUDA by the kernel that assembles a call's rows).
"""

from __future__ import annotations

from .kernels.native import native

TIER_COUNTERS: dict[str, str] = {
    "device_tier_hits": "ids served by the device tier (rows that Table.place keeps in GPU memory)",
    "host_tier_hits": "ids served by the host tier (rows that Table.place keeps in host memory)",
}

COUNTERS: dict[str, str] = {**dict(native.COUNTERS), **TIER_COUNTERS}
