"""Writing a file so that a crash leaves its old state or its new one, never half
of it: the bytes go to a temp file in the same directory and are fsynced, the temp
file is renamed over the name, and the directory is fsynced (once for a batch of
renames). Blocking: run it on a thread, never on the event loop.
"""

import os
import secrets
from pathlib import Path

TEMP_SUFFIX = ".tmp"  # a file with this suffix is a write that never finished


def write_atomically(path: Path, data: bytes) -> None:
    """Atomically (re)place ``path`` with ``data``; raises OSError on failure."""
    os.rename(write_temp(path.parent, path.name, [data]), path)
    sync_directory(path.parent)


def write_temp(directory: Path, stem: str, buffers: list) -> Path:
    """A new temp file in ``directory`` named after ``stem`` holding ``buffers``, fsynced;
    the caller renames it. Nothing is left behind when it raises."""
    temp = directory / f".{stem}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _write_all(fd, buffers)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        temp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return temp


def sync_directory(directory: Path) -> None:
    """Make the renames in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
