"""A flush that is a barrier.

``nc.flush()`` promises that the server has processed everything the connection sent
before it. nats-py (2.x) keeps that promise only for what already reached the socket:
its flush writes PING straight to the transport, while a command just made (the SUB of
``subscribe``, a PUB) waits in a queue for the client's flusher task, which may run after
the PING went out. The PONG then proves nothing about the subscription, and a request
from another connection can still find no responder. ``flush`` here writes the queue
first, through the flusher itself, then asks for the PONG."""

from nats.aio.client import Client


async def flush(nc: Client, timeout: float = 10.0) -> None:
    """Return once the server has processed every command sent on ``nc`` so far."""
    await nc._flush_pending(force_flush=True)  # what waits for the flusher task goes to the socket first
    await nc.flush(timeout=timeout)
