"""The TCP transport: its wire format (`wire.py`), a sender's connections
(`connection.py`) and writer (`writer.py`), and the receiver's listener (`listener.py`)."""

from libs.transfer.tcp.transport import TcpTransport

__all__ = ["TcpTransport"]
