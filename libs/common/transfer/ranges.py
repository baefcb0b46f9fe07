"""Sets of allowed byte ranges: what a ticket lets a sender write, checked per frame."""

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
