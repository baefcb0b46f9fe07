"""Named POSIX shared-memory segments: the memory the transfer engine moves bytes between.

A segment is a file under /dev/shm, created mode 0600 (only the same user can
map it) with an unguessable name. The creator touches every page once and
attachers map with MAP_POPULATE, so page faults (10x slower than the copy
itself) never land on a transfer's hot path.
"""

import mmap
import os
import secrets
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")


def new_segment_name(owner: str, purpose: str) -> str:
    """``kvserve-<pid>-<owner>-<purpose>-<random>``: the pid lets a later process
    remove segments whose owner died without cleaning up (SIGKILL)."""
    return f"kvserve-{os.getpid()}-{owner}-{purpose}-{secrets.token_hex(6)}"


def remove_stale_segments() -> list[str]:
    """Unlink this user's kvserve segments whose creating process is gone; return their names."""
    removed = []
    for path in SHM_DIR.glob("kvserve-*"):
        parts = path.name.split("-")
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(int(parts[1]), 0)  # signal 0: does the process exist?
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path.name)
        except (PermissionError, FileNotFoundError):
            continue
    return removed


class SharedSegment:
    def __init__(self, name: str, nbytes: int, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.nbytes = nbytes
        self._mmap = mm
        self.owner = owner
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        self.view = memoryview(mm)  # the same bytes, for sockets (recv_into / sendmsg)

    @classmethod
    def create(cls, name: str, nbytes: int) -> "SharedSegment":
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        segment = cls(name, nbytes, mm, owner=True)
        segment.tensor.zero_()  # fault every page in now, not during a transfer
        return segment

    @classmethod
    def attach(cls, name: str) -> "SharedSegment":
        if "/" in name or not name.startswith("kvserve-"):
            raise ValueError(f"not a kvserve segment name: {name!r}")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            nbytes = os.fstat(fd).st_size
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        return cls(name, nbytes, mm, owner=False)

    def close(self) -> None:
        """Unmap; the owner also removes the name (attachers keep their mapping valid). Idempotent."""
        if self._mmap is None:
            return
        if self.owner:
            try:
                os.unlink(SHM_DIR / self.name)
            except FileNotFoundError:
                pass
        self.tensor = None
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a tensor view still exists somewhere; the OS unmaps at exit
        self._mmap = None
