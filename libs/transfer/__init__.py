"""The data plane: registered memory segments and byte transfers between them."""

from libs.transfer.descriptors import Descriptor, Span, TransferError
from libs.transfer.engine import TransferEngine
from libs.transfer.segment import SharedSegment
from libs.transfer.transport import Transport

__all__ = ["Descriptor", "SharedSegment", "Span", "TransferEngine", "TransferError", "Transport"]
