"""The files a tool writes into a directory, and the refusal of a directory
that holds any other, or that cannot take them.

A tool that writes a table or a checkpoint into a directory keeps a marker
there (``layout.json``, ``ple_bench.json``): a JSON record naming the tool,
what it wrote (``what``: "a table"), the files, and whether it wrote them
to the end.  The marker is written before the first file, listing every
file the write may leave (the old ones too), and again after the last, so a
write cut short at any point leaves a marker that names all of its files and
says it is incomplete.  A tool deletes only the files its marker lists, and
refuses a directory that holds anything else, before it deletes or writes
anything: the directory a user names may hold a model of theirs
(transformers names its weights ``model.safetensors``, as ple's tables are
``*.safetensors`` too), or what another of ple's tools wrote there.  It
refuses as well, before writing, a directory where no file can be made or
whose filesystem has no room for what it writes.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

from ple_tools.argtypes import free_bytes, size, unwritable

SHOWN = 3  # foreign files named in an error; the rest are counted
MARKER_BYTES = 1 << 20  # a marker is far smaller: a larger JSON file is none


class DirectoryError(Exception):
    """A directory cannot take what a tool writes; the message names it,
    says why and what to do.  The tools' command lines print it and exit
    with status 2."""


class ForeignFilesError(DirectoryError):
    """A directory holds files that the tool did not write, so the tool writes
    nothing there."""


class UnwritableError(DirectoryError):
    """No file can be made in the directory (or under the path it would be
    made at)."""


class NoRoomError(DirectoryError):
    """The directory's filesystem has less room than the write takes."""


def partial_name(marker: Path) -> str:
    """The file a marker is written to before it replaces the marker."""
    return f".{marker.name}.partial"


def read_record(marker: Path, tool: str,
                legacy: Callable[[object], dict | None] | None = None) -> dict | None:
    """The record in ``marker`` if ``tool`` wrote it, or the one ``legacy``
    makes of an older marker's JSON; None when there is no marker or it is
    not the tool's (a file of the same name that the tool did not write).
    A record has ``files`` (names in the marker's directory) and
    ``complete``."""
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("written_by") == tool:
        record = data
    elif legacy is not None:
        record = legacy(data)
    else:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("complete"), bool):
        return None
    files = record.get("files")
    # Plain names only: a marker must not lead the tool to delete anything
    # outside its directory.
    if not isinstance(files, list) or not all(
            isinstance(f, str) and f not in ("", ".", "..") and "/" not in f for f in files):
        return None
    return record


def _other_writer(directory: Path, names: list[str]) -> tuple[str, dict] | None:
    """The first of ``names`` (in ``directory``) that is a marker of one of
    ple's tools, and its record."""
    for name in names:
        path = directory / name
        if not name.endswith(".json") or not path.is_file() or path.stat().st_size > MARKER_BYTES:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("written_by"), str) and isinstance(
                data.get("files"), list):
            return name, data
    return None


def refuse_foreign(directory: Path, marker: Path, record: dict | None, what: str) -> None:
    """Raises ForeignFilesError when ``directory`` holds anything but the
    files ``record`` lists, its marker and the marker's partial copy; and
    UnwritableError when ``directory`` is a file.  A missing directory, or
    an empty one, holds nothing foreign.  ``what``: what the tool writes
    ("a table"), for the message."""
    if not directory.exists() and not directory.is_symlink():
        return
    if not directory.is_dir():
        raise UnwritableError(f"{directory} is not a directory: name a directory for the "
                              "tool to write into (a missing one is created)")
    owned = {partial_name(marker)}
    if record is not None:
        owned |= {marker.name, *record["files"]}
    foreign = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in directory.iterdir()
                     if entry.name not in owned or entry.is_dir())
    if not foreign:
        return
    one = len(foreign) == 1
    other = _other_writer(directory, foreign)
    if other is not None:
        name, data = other
        theirs = {name, *(f for f in data["files"] if isinstance(f, str))}
        rest = [f for f in foreign if f not in theirs]
        held = data.get("what") or "files"
        raise ForeignFilesError(
            f"{directory} holds {held} that {data['written_by']} wrote there (its {name} lists "
            f"the files)" + (f", and {len(rest)} other file{'' if len(rest) == 1 else 's'}"
                             if rest else "")
            + f"; ple writes {what} only into a missing or empty directory, or one holding "
            f"{what} that it wrote there itself (listed in its {marker.name}), and deletes "
            f"nothing else: name another directory")
    shown = ", ".join(foreign[:SHOWN]) + (f" and {len(foreign) - SHOWN} more"
                                          if len(foreign) > SHOWN else "")
    raise ForeignFilesError(
        f"{directory} holds {len(foreign)} file{'' if one else 's'} that ple did not write "
        f"({shown}); ple writes its files only into a missing or empty directory, or one "
        f"holding files it wrote there itself (listed in its {marker.name}), and deletes nothing "
        f"else: name another directory, or move {'that file' if one else 'those files'} out")


def refuse_no_room(directory: Path, nbytes: int, old: dict | None, what: str) -> None:
    """Raises UnwritableError when no file can be made in ``directory``
    (created with its missing parents), and NoRoomError when its filesystem
    has less than ``nbytes`` free beside the files of ``old`` (the record
    of the write there before), which a write deletes first.  ``what``:
    what the tool writes ("a table"), for the message."""
    reason = unwritable(directory, directory=True)
    if reason is not None:
        raise UnwritableError(reason)
    freed = 0
    for name in old["files"] if old is not None else []:
        path = directory / name
        if path.is_file() and not path.is_symlink():
            freed += path.stat().st_size
    free = free_bytes(directory)
    if nbytes > free + freed:
        raise NoRoomError(f"{what} of {size(nbytes)} does not fit in {directory}: its filesystem "
                          f"has {size(free)} free" + (f", and the old files there that it "
                                                      f"replaces {size(freed)}" if freed else ""))


def refuse_on_command_line(parser: argparse.ArgumentParser, error: DirectoryError,
                           directory_option: str, size_option: str) -> NoReturn:
    """``error`` as a tool's command line gives it, once its arguments are
    parsed: a directory holding files the tool did not write on stderr,
    with exit status 2; a directory that cannot take the write in
    argparse's usage error naming ``directory_option`` (``size_option``
    where its filesystem has too little room)."""
    if isinstance(error, ForeignFilesError):
        parser.exit(2, f"error: {error}\n")
    option = size_option if isinstance(error, NoRoomError) else directory_option
    parser.error(f"argument {option}: {error}")


def write_record(marker: Path, record: dict) -> None:
    """Writes ``record`` to ``marker`` whole or not at all: to its partial
    copy first, flushed to the disk, then renamed over it."""
    partial = marker.with_name(partial_name(marker))
    with open(partial, "w") as handle:
        handle.write(json.dumps(record, indent=1) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, marker)


def begin(directory: Path, marker: Path, tool: str, old: dict | None, files: Iterable[str],
          **fields) -> None:
    """Before a write: creates ``directory`` and records, as incomplete,
    every file that the old write (``old``, its record) and the new one
    (``files``) leave there, then deletes the old files.  The caller then
    writes ``files`` and calls :func:`finish`."""
    previous = list(old["files"]) if old is not None else []
    directory.mkdir(parents=True, exist_ok=True)
    write_record(marker, {"written_by": tool, "complete": False,
                          "files": sorted({*previous, *files}), **fields})
    for name in previous:
        path = directory / name
        if path.is_file() or path.is_symlink():
            path.unlink()


def finish(marker: Path, tool: str, files: Iterable[str], **fields) -> None:
    """After a write: records ``files`` as the directory's whole content, complete."""
    write_record(marker, {"written_by": tool, "complete": True, "files": sorted(files), **fields})
