"""Heartbeats as the launcher sees them: a thread with its own event loop that
hands every Heartbeat on the bus to a callback (LocalCluster keeps the latest)."""

import asyncio
import ssl
import threading
from collections.abc import Callable

import nats
from nats.aio.msg import Msg

from libs.common import nats_auth
from libs.common.nats_flush import flush
from libs.common.service import short_tls_shutdown
from libs.protocol import schema, subjects
from libs.protocol.schema import BadMessageError, Heartbeat


class HeartbeatWatcher(threading.Thread):
    """``start()``, wait for ``subscribed`` (then check ``error``), ``stop()``."""

    def __init__(
        self,
        url: str,
        on_heartbeat: Callable[[Heartbeat], None],
        on_disconnect: Callable[[], None] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(name="kvserve-heartbeats", daemon=True)
        self._url = url
        self._tls = tls  # nats-server requires TLS (a cluster of several hosts)
        self._on_heartbeat = on_heartbeat
        self._on_disconnect = on_disconnect  # nats-server went away (the supervisor checks on it)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self.subscribed = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        with asyncio.Runner(loop_factory=short_tls_shutdown(asyncio.SelectorEventLoop)) as runner:
            runner.run(self._main())  # off a NATS server out of reach in seconds, as the services are

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        try:
            nc = await nats.connect(
                nats_auth.server_urls(self._url),
                name="kvserve-cluster",
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                **nats_auth.KEEPALIVE,
                error_cb=_quiet,  # the services' own logs say when NATS is gone
                disconnected_cb=self._disconnected,
                **({"tls": self._tls} if self._tls is not None else {}),
            )
        except Exception as e:
            self.error = e
            self.subscribed.set()
            return
        try:
            await nc.subscribe(subjects.HEARTBEAT_ALL, cb=self._on_message)
            await flush(nc)  # the server has the subscription before any service starts
            self.subscribed.set()
            await self._done.wait()
        finally:
            await nc.close()

    async def _on_message(self, msg: Msg) -> None:
        try:
            beat = schema.decode(msg.data, Heartbeat)
        except BadMessageError:
            return  # a peer speaking another protocol: it never counts as ready
        if not subjects.names_sender(msg.subject, beat.role, beat.instance_id):
            return  # in another instance's name: not to be believed
        self._on_heartbeat(beat)

    async def _disconnected(self) -> None:
        if self._on_disconnect is not None:
            self._on_disconnect()

    def stop(self) -> None:
        if self._loop is not None and self._done is not None:
            try:
                self._loop.call_soon_threadsafe(self._done.set)
            except RuntimeError:  # the loop has already ended
                pass
        self.join(timeout=5)


async def _quiet(*args: object) -> None:
    pass
