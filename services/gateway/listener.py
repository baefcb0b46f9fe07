"""The HTTP listener: aiohttp's server behind a guard against slow, idle and too many clients.

aiohttp times nothing before a request head is complete, so `ConnectionGuard`
wraps the server's protocol factory. It caps the open connections (one past the
cap is answered 503 and closed at once), closes a connection whose request head
(request line and headers) is not complete within ``header_timeout`` of the
connection opening or of its first byte after an idle pause, and closes one that
stays idle between requests for ``keepalive_timeout``. A request's body is timed
by the handler that reads it.
"""

import asyncio
import logging
from collections.abc import Callable

import msgspec
from aiohttp import web

from services.gateway.errors import error_body

log = logging.getLogger("kvserve.gateway.http")

# What the gateway's application needs of the server that runs it: request bodies
# as sent, so their Content-Encoding is undone under the body limit
# (request_limits.decode_content), not inflated unbounded before a handler runs.
SERVER_OPTIONS = {"auto_decompress": False}


def _busy_response() -> bytes:
    body = msgspec.json.encode(
        error_body("The server has too many open connections; retry shortly.", "server_error", None,
                   "too_many_connections")
    )  # fmt: skip
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


BUSY_RESPONSE = _busy_response()


class ConnectionGuard:
    """Every connection a listener accepts, with the timers that close the stalled ones."""

    def __init__(self, header_timeout: float, keepalive_timeout: float, max_connections: int) -> None:
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        self.max_connections = max_connections
        self.num_open = 0  # counted when the protocol is made, before the loop connects it
        self.num_refused = 0
        self._served: dict[web.RequestHandler, "_GuardedConnection"] = {}  # by the aiohttp protocol inside

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """What ``loop.create_server`` calls for each accepted connection, in place of ``server``."""

        def make() -> asyncio.Protocol:
            if self.num_open >= self.max_connections:
                self.num_refused += 1
                if self.num_refused & (self.num_refused - 1) == 0:  # 1st, 2nd, 4th...: informative, not a flood
                    log.warning("%d connections open, the cap: refused a connection (%d so far)",
                                self.num_open, self.num_refused)  # fmt: skip
                return _Refused()
            self.num_open += 1
            return _GuardedConnection(self, server())

        return make

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """Tells the connection a request is being served, so no timer runs meanwhile."""
        connection = self._served.get(request.protocol)
        if connection is None:  # a site this guard does not watch (a test server)
            return await handler(request)
        connection.request_started()
        try:
            return await handler(request)
        finally:
            connection.request_finished()


class _GuardedConnection(asyncio.Protocol):
    """One client connection: aiohttp's protocol, with the guard's timers around it."""

    def __init__(self, guard: ConnectionGuard, protocol: web.RequestHandler) -> None:
        self.guard = guard
        self.protocol = protocol
        self.num_serving = 0  # requests being served (pipelined ones may overlap)
        self.is_idle = False  # between requests: the next byte starts a new request head
        self.is_closed = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.guard._served[self.protocol] = self
        self.protocol.connection_made(transport)
        self._arm(self.guard.header_timeout, "no complete request head")

    def data_received(self, data: bytes) -> None:
        if self.is_idle:  # the next request begins: its head has header_timeout to arrive
            self.is_idle = False
            self._arm(self.guard.header_timeout, "no complete request head")
        self.protocol.data_received(data)

    def eof_received(self) -> bool | None:
        return self.protocol.eof_received()

    def pause_writing(self) -> None:
        self.protocol.pause_writing()

    def resume_writing(self) -> None:
        self.protocol.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        self._cancel()
        self.guard._served.pop(self.protocol, None)
        self.guard.num_open -= 1
        self.protocol.connection_lost(exc)

    def request_started(self) -> None:
        self.num_serving += 1
        self.is_idle = False
        self._cancel()

    def request_finished(self) -> None:
        self.num_serving -= 1
        if self.num_serving == 0 and not self.is_closed:
            self.is_idle = True
            self._arm(self.guard.keepalive_timeout, "idle")

    def _arm(self, seconds: float, reason: str) -> None:
        self._cancel()
        self.timer = asyncio.get_running_loop().call_later(seconds, self._expire, reason)

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self, reason: str) -> None:
        self.timer = None
        log.debug("closing a connection: %s", reason)
        self.protocol.force_close()


class _Refused(asyncio.Protocol):
    """A connection past the cap: answered 503 and closed before anything is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(BUSY_RESPONSE)
        transport.close()


class GuardedSite(web.BaseSite):
    """A TCP site whose every connection goes through ``guard``."""

    __slots__ = ("_host", "_port", "_guard")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        factory = self._guard.protocol_factory(self._runner.server)
        self._server = await asyncio.get_running_loop().create_server(factory, self._host, self._port)


async def serve(app: web.Application, host: str, port: int, guard: ConnectionGuard,
                shutdown_timeout: float) -> web.AppRunner:  # fmt: skip
    """Listen on (host, port) with ``app`` behind ``guard``; the caller cleans the runner up.
    ``app`` must have ``guard.middleware`` outermost."""
    # aiohttp's own keep-alive timer only backs the guard's up: it never fires first
    keepalive = guard.header_timeout + guard.keepalive_timeout
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout,
                           keepalive_timeout=keepalive, **SERVER_OPTIONS)  # fmt: skip
    await runner.setup()
    try:
        await GuardedSite(runner, host, port, guard).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
