"""Saving over a file that this process maps: written beside it and renamed.

A table maps its files, and so do the tensors of a model's state dict that
hold a table (``Table.checkpoint_tensors``).  A writer that truncated such a
file in place (``open(path, "wb")``) would pull the pages from under the
mappings: a gather or a save that reads them then gets SIGBUS, or bytes of
the new file.  safetensors (0.8 and later) writes every file beside its
destination and renames it, so its ``save_file`` (under whatever name
transformers, accelerate, PEFT or a Trainer imported it) never truncates
one; the mappings keep the old file, whose blocks the filesystem frees when
the last mapping goes.  ``torch.save`` to a path truncates: once a table is
open, torch's zip file writer (``torch.serialization._open_zipfile_writer``,
which ``torch.save`` looks up at each call; ple's one patch on torch) writes
a file that this process maps beside it and renames it the same way.  Every
other path is written as before.  Writers of their own (``open(path,
"wb")``, NumPy) are not covered (docs/reliability.md)."""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path

__all__ = ["guard_writers", "is_mapped"]

MARKER = "__ple_writes_beside_mapped_files__"
_installed = threading.Lock()


def is_mapped(path: str | os.PathLike) -> bool:
    """Whether this process maps the file ``path`` names (a symlink's
    target), by its identity: ``/proc/self/maps`` (Linux) lists the device
    and inode of every file mapping."""
    try:
        st = os.stat(path)
        maps = Path("/proc/self/maps").read_text()
    except (OSError, ValueError):
        return False
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    inode = str(st.st_ino)
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) >= 5 and fields[4] == inode and fields[3] == device:
            return True
    return False


@contextmanager
def replacing(path: str | os.PathLike):
    """A path to write ``path``'s new content to, renamed over ``path`` once
    the block inside has written it (removed if it raises); the new file
    takes the old one's permissions."""
    path = Path(path)
    beside = path.with_name(f".{path.name}.ple-{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        yield beside
        os.chmod(beside, os.stat(path).st_mode & 0o7777)
        os.replace(beside, path)
    finally:
        if beside.exists():
            beside.unlink()


def guard_writers() -> None:
    """Puts the patch in place, once a process."""
    with _installed:
        _guard_torch_save()


def _guard_torch_save() -> None:
    import torch.serialization as module

    open_writer = module._open_zipfile_writer
    if getattr(open_writer, MARKER, False):
        return

    def writes_beside_mapped_files(name_or_buffer):
        if not isinstance(name_or_buffer, (str, os.PathLike)) or not is_mapped(name_or_buffer):
            return open_writer(name_or_buffer)
        return _WriterBeside(open_writer, name_or_buffer)

    setattr(writes_beside_mapped_files, MARKER, True)
    module._open_zipfile_writer = writes_beside_mapped_files


class _WriterBeside:
    """torch's zip file writer over a file beside ``path``, renamed over it on
    a clean exit."""

    def __init__(self, open_writer, path):
        self._replacing = replacing(path)
        self._writer = open_writer(str(self._replacing.__enter__()))

    def __enter__(self):
        return self._writer.__enter__()

    def __exit__(self, *exc) -> None:
        try:
            self._writer.__exit__(*exc)
        except BaseException as error:
            self._replacing.__exit__(type(error), error, error.__traceback__)
            raise
        self._replacing.__exit__(*exc)
