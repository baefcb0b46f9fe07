"""Sets of byte ranges: what a ticket lets a sender write, and what it has written, checked per frame."""

import bisect


class RangeSet:
    """Disjoint ranges, merged where they touch; ``contains`` is O(log n)."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for offset, length in sorted(ranges):
            if length <= 0:
                continue
            if merged and offset <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], offset + length)
            else:
                merged.append([offset, offset + length])
        self._starts = [start for start, _ in merged]
        self._ends = [end for _, end in merged]
        self.total = sum(end - start for start, end in merged)

    def contains(self, offset: int, length: int) -> bool:
        i = bisect.bisect_right(self._starts, offset) - 1
        return i >= 0 and length >= 0 and offset + length <= self._ends[i]


class WrittenRanges:
    """Ranges written so far, merged where they touch; ``add`` refuses any overlap,
    so every byte of a ticket is written at most once. Not thread-safe."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.total = 0

    def add(self, offset: int, length: int) -> bool:
        """Record ``[offset, offset + length)``; False (and nothing recorded) if any of it was written."""
        if length <= 0:
            return True
        end = offset + length
        starts, ends = self._starts, self._ends
        i = bisect.bisect_right(starts, offset)  # ranges before i start at or before offset
        if (i > 0 and ends[i - 1] > offset) or (i < len(starts) and starts[i] < end):
            return False
        joins_left = i > 0 and ends[i - 1] == offset
        joins_right = i < len(starts) and starts[i] == end
        if joins_left and joins_right:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        elif joins_left:
            ends[i - 1] = end
        elif joins_right:
            starts[i] = offset
        else:
            starts.insert(i, offset)
            ends.insert(i, end)
        self.total += length
        return True
