"""What a transfer is: a batch of (segment, offset, length) -> (segment, offset) copies."""

from dataclasses import dataclass


class TransferError(Exception):
    """A transfer that did not complete; ``cause`` says why (timeout, peer_gone, bad_descriptor, ...)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(f"{cause}: {message}")
        self.cause = cause


@dataclass(frozen=True)
class Descriptor:
    src_segment: str
    src_offset: int
    dst_segment: str
    dst_offset: int
    length: int
