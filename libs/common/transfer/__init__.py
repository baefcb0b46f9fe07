"""The data plane: registered memory segments and byte transfers between them."""

from libs.common.transfer.descriptors import Cause, Descriptor, Span, TransferError
from libs.common.transfer.engine import TransferEngine
from libs.common.transfer.segment import SharedSegment
from libs.common.transfer.transport import Transport

__all__ = ["Cause", "Descriptor", "SharedSegment", "Span", "TransferEngine", "TransferError", "Transport"]
