"""What a transfer is, and how it can fail.

A transfer writes byte ranges of a source segment into byte ranges of a
destination segment. The receiver grants each transfer a `WriteTicket` (over
the control plane): where to write and a one-time token; the sender writes
``Span``s through whichever transport reaches that place.
"""

from dataclasses import dataclass

from libs.protocol.vocabulary import ErrorCode

# Why a transfer can end badly: the `ErrorCode` a service replies with when a transfer
# it needed failed, and the labels of the failure metric.
CAUSES = (
    ErrorCode.TIMEOUT,
    ErrorCode.PEER_GONE,
    ErrorCode.BAD_TOKEN,
    ErrorCode.BAD_RANGE,
    ErrorCode.TRUNCATED,
    ErrorCode.TLS,
    ErrorCode.CANCELLED,
    ErrorCode.INTERNAL,  # a bug in the engine, not the peer's doing
)


class TransferError(Exception):
    """A transfer that did not complete, and why."""

    def __init__(self, cause: ErrorCode, message: str) -> None:
        super().__init__(f"{cause}: {message}")
        self.cause = cause


@dataclass(frozen=True)
class Span:
    """Copy ``length`` bytes at ``src_offset`` of the source to ``dst_offset`` of the destination."""

    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class Descriptor:
    """A span between two named segments, both mapped in this process."""

    src_segment: str
    src_offset: int
    dst_segment: str
    dst_offset: int
    length: int


def split_spans(spans: list[Span], max_bytes: int) -> list[Span]:
    """Cut spans longer than ``max_bytes`` into slices, so they can go over several connections."""
    out = []
    for span in spans:
        for start in range(0, span.length, max_bytes):
            n = min(max_bytes, span.length - start)
            out.append(Span(span.src_offset + start, span.dst_offset + start, n))
    return out
