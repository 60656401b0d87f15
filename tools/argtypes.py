"""argparse types of the tools' numeric options, and the check that a table
size holds a row.

A value no run can use (a table of -5 MiB, 0 shards, a seed the random
generators refuse, an endless timeout) ends in argparse's usage error: exit
status 2 and one line naming the option and what it takes, before a tool
imports torch or writes anything.

    parser.add_argument("--shards", type=positive_int, default=8, ...)
    # ple-make-table: error: argument --shards: expected an integer above 0, got '0'
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


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


positive_int = _bounded(int, "an integer above 0", 0, lowest_allowed=False)
non_negative_int = _bounded(int, "an integer of 0 or more", 0, lowest_allowed=True)
positive_float = number_above(0)
non_negative_float = _bounded(float, "a number of 0 or more", 0, lowest_allowed=True)
# NumPy's and torch's generators both take these.
seed = _bounded(int, "an integer from 0 to 2**64 - 1", 0, lowest_allowed=True, highest=2**64 - 1)


def positive_int_list(text: str) -> str:
    """Comma separated integers above 0, or none (``""``); the text itself,
    which the tools split where they use it."""
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            positive_int(item)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected integers above 0, comma separated, got {text!r}") from None
    return text


def refuse_empty_table(parser: argparse.ArgumentParser, option: str, table_bytes: float,
                       row_bytes: int) -> None:
    """argparse's usage error when ``option`` asks for a table of
    ``table_bytes`` that holds no row of ``row_bytes``."""
    if int(table_bytes) // row_bytes == 0:
        parser.error(f"argument {option}: a table of {int(table_bytes)} bytes holds no row of "
                     f"{row_bytes} bytes")
