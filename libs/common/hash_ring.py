"""Consistent hashing: which store instances own a block hash.

Each instance is placed on a 64-bit ring at ``vnodes`` points (blake2b of
``instance id/i``); a key belongs to the first instance clockwise from the
key's own point, and its replicas to the next distinct instances after it.
Adding an instance moves only the keys that now fall to it; removing one moves
only its keys. Pure and deterministic: every process with the same members
computes the same owners.
"""

import bisect
import hashlib
from collections.abc import Iterable

DEFAULT_VNODES = 128


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, members: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be positive")
        self.vnodes = vnodes
        self._members: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []
        for member in members:
            self.add(member)

    @property
    def members(self) -> list[str]:
        return sorted(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def add(self, member: str) -> None:
        if member in self._members:
            return
        self._members.add(member)
        for i in range(self.vnodes):
            point = _point(f"{member}/{i}".encode())
            at = bisect.bisect_left(self._points, point)
            # a collision (astronomically rare) is broken by member id, so every process agrees
            while at < len(self._points) and self._points[at] == point and self._owners[at] < member:
                at += 1
            self._points.insert(at, point)
            self._owners.insert(at, member)

    def remove(self, member: str) -> None:
        if member not in self._members:
            return
        self._members.discard(member)
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != member]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def owners(self, key: bytes, replicas: int = 1) -> list[str]:
        """The first ``replicas`` distinct members clockwise from ``key`` (fewer if there are fewer)."""
        if not self._points:
            return []
        want = min(replicas, len(self._members))
        out: list[str] = []
        i = bisect.bisect_right(self._points, _point(key))
        for step in range(len(self._points)):
            owner = self._owners[(i + step) % len(self._points)]
            if owner not in out:
                out.append(owner)
                if len(out) == want:
                    break
        return out

    def owner(self, key: bytes) -> str | None:
        found = self.owners(key, 1)
        return found[0] if found else None
