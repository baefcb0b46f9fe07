"""The data plane: registered memory segments and byte transfers between them."""

from libs.common.transfer.descriptors import Descriptor, Span, TransferError
from libs.common.transfer.engine import TransferEngine
from libs.common.transfer.segment import SharedSegment

__all__ = ["Descriptor", "SharedSegment", "Span", "TransferEngine", "TransferError"]
