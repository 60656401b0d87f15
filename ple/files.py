"""Opening table files: regular files only.

A FIFO opened for reading blocks until a writer comes (forever, for a FIFO
that someone left named ``*.safetensors`` in a checkpoint directory); a
character device such as ``/dev/zero`` reads without end; a socket cannot be
opened; a block device has no size that ``fstat`` reports, so it could not be
mapped.  Every reader of table files in ple goes through :func:`open_regular`,
which refuses all of these with a ``ValueError`` naming the path, before the
file is opened for reading.  An empty path is refused too: ``Path("")`` is
the working directory, which a caller who passed an unset variable did not
mean."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

# Run from a folder that holds another folder named "ple" (one that is no
# checkout of ple: a checkout's top folder says so itself), Python imports it
# as a namespace package in place of the installed ple: ple/__init__.py never
# runs, so torch.ops.ple is never registered, and the modules that import this
# one are still found.  Here is the first place of ple's own code that such an
# import reaches.
_package = sys.modules.get(__package__)
if _package is not None and getattr(_package, "__file__", None) is None:
    raise ImportError(
        f"'{__package__}' was imported as a namespace package from "
        f"{', '.join(_package.__path__)}: a folder named '{__package__}' there (a clone of the ple "
        "repository?) hides the installed ple, whose operators are then never registered; run "
        "Python from another folder")

KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in KINDS if test(mode)), f"file type {stat.S_IFMT(mode):#o}")


def _refuse(path, mode: int) -> ValueError:
    return ValueError(f"{path}: not a regular file ({_kind(mode)}); ple reads tables and their "
                      "tensors only from regular files")


def nonempty_path(path: str | os.PathLike) -> Path:
    """``path`` as a ``Path``; a ``ValueError`` when it is empty."""
    if not os.fspath(path):
        raise ValueError("an empty path names no table file (it would be the working directory); "
                         "give a file or a directory")
    return Path(path)


def check_regular_file(path: str | os.PathLike) -> None:
    """Raises ``ValueError`` naming ``path`` when it is not a regular file (a
    symlink counts as what it points to) or is empty, and ``OSError`` when it
    cannot be stat'ed (``FileNotFoundError`` when missing).  Opens nothing."""
    mode = os.stat(nonempty_path(path)).st_mode
    if not stat.S_ISREG(mode):
        raise _refuse(path, mode)


def resolved_regular_file(path: str | os.PathLike) -> Path:
    """The absolute real path (every symlink resolved) of the regular file
    ``path``, checked as by :func:`check_regular_file` under the name given.
    A table opens its files by these paths, once: its copies, pickles and
    spawned workers open the same files whatever the working directory or
    the links are by then."""
    check_regular_file(path)
    return Path(path).resolve(strict=True)


def open_regular(path: str | os.PathLike) -> int:
    """A file descriptor open for reading on the regular file ``path``.

    ``path`` is checked before it is opened, and opened with ``O_NONBLOCK``
    and checked again by ``fstat``, so that a path that turns into a FIFO
    between the two cannot block the open either (``O_NONBLOCK`` is then
    cleared: it means nothing to a regular file).  Raises as
    :func:`check_regular_file` does."""
    check_regular_file(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular_binary(path: str | os.PathLike):
    """:func:`open_regular` as a binary file object (``open(path, "rb")``)."""
    return os.fdopen(open_regular(path), "rb")
