"""Progress bars for long work: tqdm's, on stderr, when asked for."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def rows_progress(progress: Callable[[int, int], None] | bool | None, row_bytes: int,
                  desc: str) -> Iterator[Callable[[int, int], None] | None]:
    """``progress`` as a ``progress(done_rows, total_rows)`` callback for the
    block: a callable as given, None or False as None, True as a tqdm bar of
    the bytes done (closed when the block ends)."""
    if progress is None or progress is False:
        yield None
        return
    if progress is not True:
        if not callable(progress):
            raise TypeError(f"ple: progress must be True, False, None or a callable "
                            f"progress(done, total), not {type(progress).__name__}")
        yield progress
        return
    from tqdm.auto import tqdm

    with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr) as bar:
        def update(done: int, total: int) -> None:
            bar.total = total * row_bytes
            bar.update(done * row_bytes - bar.n)

        yield update
