"""argparse types of the tools' options, and the checks a tool runs on its
arguments once they are parsed.

A value no run can use (a table of -5 MiB, 0 shards, a seed the random
generators refuse, 300 gather threads, an endless timeout, a path no file
can be written under, more memory than the machine has) ends in argparse's
usage error: exit status 2 and one line naming the option and what it
takes, before a tool writes anything (and, for a value a type refuses,
before it imports torch).

    parser.add_argument("--shards", type=positive_int, default=8, ...)
    # ple-make-table: error: argument --shards: expected an integer above 0, got '0'

The library's limits are spelled out here, so that a tool refuses a value
without importing ple (and torch); tests/test_tools_cli.py checks that they
are the library's.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

# ple.config.RANGES and POLICIES (kernels/gather_config.h).
MAX_THREADS = 256
MAX_PREFETCH_WINDOW_KIB = 2**40
MAX_ROW_CACHE_MIB = 2**40
MAX_IO_QUEUE_DEPTH = 1024
MAX_IO_BLOCK_BYTES = 65536
POLICIES = ("window", "distance", "all", "none")
# ple.layers.lookahead.MOST_BYTES in MiB: what a table's prefetches hold at most.
MAX_LOOKAHEAD_MIB = 256
# The longest wait Python's timeouts and time.sleep take, in seconds.
MAX_SECONDS = threading.TIMEOUT_MAX


def _bounded(kind: type, what: str, lowest: float, *, lowest_allowed: bool,
             highest: float = math.inf) -> Callable[[str], object]:
    """An argparse type: ``kind(text)``, finite, at least (or above)
    ``lowest`` and at most ``highest``; ``what`` names what it takes."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        # NaN compares false with everything; an int compares with inf without
        # the float conversion (math.isfinite's) that a large one overflows.
        if not (lowest <= value <= highest) or abs(value) == math.inf or (
                value == lowest and not lowest_allowed):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def number_above(lowest: float) -> Callable[[str], float]:
    """An argparse type: a finite number above ``lowest``."""
    return _bounded(float, f"a number above {lowest:g}", lowest, lowest_allowed=False)


def int_range(lowest: int, highest: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``lowest`` to ``highest``; ``why``
    says whose bound that is."""
    def shown(bound: int) -> str:
        return f"2**{bound.bit_length() - 1}" if bound >= 2**20 and bound & (bound - 1) == 0 \
            else str(bound)

    return _bounded(int, f"an integer from {lowest} to {shown(highest)}{why}", lowest,
                    lowest_allowed=True, highest=highest)


positive_int = _bounded(int, "an integer above 0", 0, lowest_allowed=False)
non_negative_int = _bounded(int, "an integer of 0 or more", 0, lowest_allowed=True)
positive_float = number_above(0)
non_negative_float = _bounded(float, "a number of 0 or more", 0, lowest_allowed=True)
# NumPy's and torch's generators both take these.
seed = _bounded(int, "an integer from 0 to 2**64 - 1", 0, lowest_allowed=True, highest=2**64 - 1)
# GatherConfig's fields, as ple.GatherConfig checks them.
gather_threads = int_range(1, MAX_THREADS, " (GatherConfig.threads)")
row_cache_mib = int_range(0, MAX_ROW_CACHE_MIB, " (GatherConfig.row_cache_mib)")
window_kib = int_range(0, MAX_PREFETCH_WINDOW_KIB, " (GatherConfig.prefetch_window_kib)")
io_queue_depth = int_range(1, MAX_IO_QUEUE_DEPTH, " (GatherConfig.io_queue_depth)")
lookahead_mib = int_range(1, MAX_LOOKAHEAD_MIB, " (what a table's prefetches hold at most)")
# Durations that Python's timeouts and sleeps take.
seconds = _bounded(float, f"a number of seconds above 0, at most {MAX_SECONDS:.0f}", 0,
                   lowest_allowed=False, highest=MAX_SECONDS)
milliseconds = _bounded(float, f"a number of milliseconds of 0 or more, at most "
                        f"{MAX_SECONDS * 1000:.0f}", 0, lowest_allowed=True,
                        highest=MAX_SECONDS * 1000)


def io_block_bytes(text: str) -> int:
    """An argparse type: a power of two up to MAX_IO_BLOCK_BYTES
    (GatherConfig.io_block_bytes, other than 0)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 0 < value <= MAX_IO_BLOCK_BYTES or value & (value - 1):
        raise argparse.ArgumentTypeError(
            f"expected a power of two from 1 to {MAX_IO_BLOCK_BYTES} "
            f"(GatherConfig.io_block_bytes), got {text!r}")
    return value


def int_list(item: Callable[[str], int], what: str) -> Callable[[str], str]:
    """An argparse type: comma separated values that ``item`` takes, or none
    (``""``); the text itself, which the tools split where they use it.
    ``what`` names what it takes."""

    def parse(text: str) -> str:
        for part in filter(None, (part.strip() for part in text.split(","))):
            try:
                item(part)
            except argparse.ArgumentTypeError:
                raise argparse.ArgumentTypeError(
                    f"expected {what}, comma separated, got {text!r}") from None
        return text

    return parse


positive_int_list = int_list(positive_int, "integers above 0")
row_cache_mib_list = int_list(int_range(1, MAX_ROW_CACHE_MIB), "integers from 1 to 2**40 "
                              "(GatherConfig.row_cache_mib)")
window_kib_list = int_list(window_kib, "integers from 0 to 2**40 "
                           "(GatherConfig.prefetch_window_kib)")
io_queue_depth_list = int_list(io_queue_depth, f"integers from 1 to {MAX_IO_QUEUE_DEPTH} "
                               "(GatherConfig.io_queue_depth)")
io_block_bytes_list = int_list(io_block_bytes, f"powers of two from 1 to {MAX_IO_BLOCK_BYTES} "
                               "(GatherConfig.io_block_bytes)")


def policy_spec(text: str) -> str:
    """An argparse type: ``policy`` or ``policy:KiB``, as
    GatherConfig.from_spec takes it."""
    policy, colon, kib = text.partition(":")
    # (isdigit before int: int() refuses a string of more than 4,300 digits)
    if policy not in POLICIES or colon and not (
            kib.isdigit() and len(kib) < 20 and int(kib) <= MAX_PREFETCH_WINDOW_KIB):
        raise argparse.ArgumentTypeError(
            f"expected a policy of {', '.join(POLICIES)}, or policy:KiB with KiB from 0 to 2**40, "
            f"got {text!r}")
    return text


def fraction_pair(text: str) -> tuple[float, float]:
    """An argparse type: two numbers of 0 or more, comma separated, whose sum
    is at most 1."""
    try:
        pair = tuple(float(part) for part in text.split(","))
    except ValueError:
        pair = ()
    # NaN fails every comparison: all() of the comparisons refuses it.
    if len(pair) != 2 or not (all(0 <= value <= 1 for value in pair) and sum(pair) <= 1):
        raise argparse.ArgumentTypeError(
            f"expected two fractions of 0 or more whose sum is at most 1, comma separated, "
            f"got {text!r}")
    return pair


def refuse_empty_table(parser: argparse.ArgumentParser, option: str, table_bytes: float,
                       row_bytes: int) -> None:
    """argparse's usage error when ``option`` asks for a table of
    ``table_bytes`` that holds no row of ``row_bytes``."""
    if int(table_bytes) // row_bytes == 0:
        parser.error(f"argument {option}: a table of {int(table_bytes)} bytes holds no row of "
                     f"{row_bytes} bytes")


# ---- checks of parsed arguments -----------------------------------------------------

def size(nbytes: float) -> str:
    """``nbytes`` for a message: in the largest binary unit that leaves 1 or more."""
    for unit, shift in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20),
                        ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{int(nbytes)} bytes"


def physical_memory() -> int:
    """The machine's memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def refuse_over_memory(parser: argparse.ArgumentParser, option: str, nbytes: float,
                       what: str) -> None:
    """argparse's usage error naming ``option`` when ``what`` (which it
    sizes) needs more than the machine's memory."""
    memory = physical_memory()
    if nbytes > memory:
        parser.error(f"argument {option}: {what} takes {size(nbytes)} of memory, more than this "
                     f"machine's {size(memory)}")


def existing_ancestor(path: Path) -> Path:
    """``path`` itself, or its nearest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unwritable(path: Path, *, directory: bool) -> str | None:
    """Why no file can be written at ``path`` (a directory, created with its
    missing parents, when ``directory``; else a file, its missing parents
    created), or None.  Tries to create an unnamed file (O_TMPFILE, else
    one removed at once) in the nearest directory that exists: a read-only
    filesystem, a pseudo-filesystem (/proc, /sys) or a directory of someone
    else's refuses it, as it would refuse the tool's files."""
    if directory and path.exists() and not path.is_dir():
        return f"{path} is not a directory"
    if not directory and path.is_dir():
        return f"{path} is a directory, not a file"
    if not directory and path.exists() and not os.access(path, os.W_OK):
        return f"{path} cannot be written by this user"
    parent = existing_ancestor(path if directory else path.parent)
    if not parent.is_dir():
        return f"{parent} is not a directory, so nothing can be made under it"
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as error:
        return f"no file can be written in {parent} ({error.strerror or error})"
    return None


def refuse_unwritable(parser: argparse.ArgumentParser, option: str, path: Path | None, *,
                      directory: bool) -> None:
    """argparse's usage error naming ``option`` when nothing can be written
    at ``path`` (see unwritable); nothing for None (the option unset)."""
    if path is not None:
        reason = unwritable(path, directory=directory)
        if reason is not None:
            parser.error(f"argument {option}: {reason}")


def free_bytes(path: Path) -> int:
    """The bytes free to this user on the filesystem that holds, or will
    hold, ``path``."""
    return shutil.disk_usage(existing_ancestor(path)).free


def refuse_missing_program(parser: argparse.ArgumentParser, option: str, program: str) -> None:
    """argparse's usage error naming ``option`` when ``program`` is neither
    an executable file nor a command on PATH."""
    if shutil.which(program) is None:
        parser.error(f"argument {option}: no program {program!r} (neither an executable file nor "
                     "a command on PATH)")


class OutputFile(argparse.Action):
    """An option naming a file the tool writes (its missing directories
    made): refused, with argparse's usage error, where no file can be
    written (see unwritable)."""

    def __call__(self, parser, namespace, value, option_string=None):
        reason = unwritable(Path(value), directory=False)
        if reason is not None:
            raise argparse.ArgumentError(self, reason)
        setattr(namespace, self.dest, Path(value))


class OutputDirectory(argparse.Action):
    """An option naming a directory the tool writes files in (made with its
    missing parents): refused, with argparse's usage error, where no file
    can be written (see unwritable)."""

    def __call__(self, parser, namespace, value, option_string=None):
        reason = unwritable(Path(value), directory=True)
        if reason is not None:
            raise argparse.ArgumentError(self, reason)
        setattr(namespace, self.dest, Path(value))


class InputFile(argparse.Action):
    """An option naming a file the tool reads: refused, with argparse's
    usage error, unless it is a regular file this process can read."""

    def __call__(self, parser, namespace, value, option_string=None):
        path = Path(value)
        if not path.is_file():
            raise argparse.ArgumentError(
                self, f"{path} is {'not a regular file' if path.exists() else 'missing'}")
        if not os.access(path, os.R_OK):
            raise argparse.ArgumentError(self, f"{path} cannot be read by this user")
        setattr(namespace, self.dest, path)
