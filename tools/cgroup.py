"""A memory cgroup that a benchmark creates for a child process, reads, and
removes: cgroup v2 (a group under the hierarchy's root) or v1 (a group nested
in this process's memory cgroup).  Creating one needs root or a delegated
cgroup; without, the constructor raises CgroupError saying why."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

MiB = 2**20
CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_MEMORY = CGROUP_ROOT / "memory"


class CgroupError(RuntimeError):
    pass


def own_cgroup(version: int) -> str:
    """This process's cgroup path (v2), or its memory cgroup path (v1)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (version == 2 and controllers == "") or (
                    version == 1 and "memory" in controllers.split(",")):
                return path
    return "/"


class MemoryCgroup:
    """A memory cgroup this tool creates for one arm's child, and removes.

    cgroup v2 (/sys/fs/cgroup/cgroup.controllers exists): a group under the
    root of the hierarchy with memory.high = limit (reclaim and throttle above
    it, as a serving machine's limit does) and memory.max = limit + 1/8 (the OOM line).
    cgroup v1: a group nested in this process's memory cgroup under
    /sys/fs/cgroup/memory/ with memory.limit_in_bytes = limit."""

    def __init__(self, name: str, limit_mib: int):
        self.version = 2 if (CGROUP_ROOT / "cgroup.controllers").exists() else 1
        if self.version == 2:
            base = CGROUP_ROOT
        else:
            if not (V1_MEMORY / "memory.limit_in_bytes").exists():
                raise CgroupError(f"no cgroup v2 hierarchy at {CGROUP_ROOT} and no cgroup v1 "
                                  f"memory controller at {V1_MEMORY}")
            base = V1_MEMORY / own_cgroup(1).lstrip("/")
        self.path = base / name
        self.limit = limit_mib * MiB
        try:
            self.path.mkdir()
        except OSError as error:
            raise CgroupError(f"cannot create the memory cgroup {self.path}: {error}") from None
        try:
            if self.version == 2 and "memory" not in (self.path / "cgroup.controllers").read_text().split():
                (base / "cgroup.subtree_control").write_text("+memory")
            self.set_limit(self.limit)
        except OSError as error:
            self.remove()
            raise CgroupError(f"cannot set the memory limit of {self.path}: {error}") from None

    def set_limit(self, limit: int) -> None:
        """Sets the limit, in bytes (v2: memory.high, and memory.max 1/8 above
        it; v1: memory.limit_in_bytes); below the usage, the kernel reclaims."""
        if self.version == 2:
            if limit > self.limit:  # memory.max first when raising, last when lowering
                self._write("memory.max", str(limit + limit // 8))
            self._write("memory.high", str(limit))
            self._write("memory.max", str(limit + limit // 8))
        else:
            self._write("memory.limit_in_bytes", str(limit))
        self.limit = limit

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def stat(self) -> dict[str, int]:
        return {k: int(v) for k, v in (line.split() for line in self.read("memory.stat").splitlines())}

    def oom_kills(self) -> int:
        try:
            text = self.read("memory.events" if self.version == 2 else "memory.oom_control")
        except OSError:
            return 0
        return next((int(line.split()[1]) for line in text.splitlines()
                     if line.startswith("oom_kill ")), 0)

    def memory_stall_s(self) -> float | None:
        """Seconds that some task of the cgroup stalled on memory (reclaim,
        and the throttling of memory.high among it): cgroup v2's PSI
        ``memory.pressure``; None where the kernel keeps none."""
        try:
            some = self.read("memory.pressure").splitlines()[0]
        except (OSError, IndexError):
            return None
        return int(some.rsplit("total=", 1)[1]) / 1e6

    def usage(self) -> int:
        return int(self.read("memory.current" if self.version == 2 else "memory.usage_in_bytes"))

    def peak(self) -> int | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(self.read(name))
        except OSError:
            return None

    def cache_and_anon(self) -> tuple[int, int]:
        stat = self.stat()
        if self.version == 2:
            return stat.get("file", 0), stat.get("anon", 0)
        return stat.get("cache", 0), stat.get("rss", 0)

    def enter(self) -> None:
        self._write("cgroup.procs", str(os.getpid()))

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # a child that just exited may still be listed
        print(f"warning: could not remove {self.path}", file=sys.stderr)

    @classmethod
    def attach(cls, path: str, version: int, limit: int) -> "MemoryCgroup":
        group = cls.__new__(cls)
        group.path, group.version, group.limit = Path(path), version, limit
        return group
