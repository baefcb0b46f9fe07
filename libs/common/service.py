"""The base every kvserve service stands on: NATS, heartbeats, handlers, shutdown.

A service connects to NATS (and keeps reconnecting forever, logging each
attempt), publishes a Heartbeat every second, decodes every message through
`schema.decode` (a message that does not decode is logged and dropped, never a
crash), and on SIGTERM/SIGINT stops taking work, drains NATS and exits 0, whether
NATS is up or not.
"""

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Protocol, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from libs.common import heap, metrics_server, nats_auth
from libs.common.metrics import Metrics
from libs.common.settings import ServiceSettings
from libs.common.tls import mutual_context
from libs.protocol import schema, subjects
from libs.protocol.ids import InstanceId
from libs.protocol.models import model_name
from libs.protocol.schema import BadMessageError, ErrorReply, Heartbeat, Message
from libs.protocol.vocabulary import ErrorCode

M = TypeVar("M", bound=Message)
EXIT_FAILED = 70  # EX_SOFTWARE: an essential task failed (the log says which and why)
# A TLS connection upgraded in place (nats-py's to nats-server between hosts) that is closed
# waits this long for its peer's close_notify, not asyncio's and uvloop's 30 s: nats-py
# closes a connection it found stale (a host whose link went down) and waits for that before
# it tries the next server, so the default kept a worker off NATS for half a minute more.
TLS_SHUTDOWN_TIMEOUT_S = 2.0
Handler = Callable[[M, Msg], Awaitable[Message | None]]


class HeardView(Protocol):
    """What a service knows of its peers from their heartbeats (`peers.PeerDirectory`, the
    conductor's `ClusterView`): while this process is cut off from NATS, their silence is its own."""

    def deaf(self) -> None: ...

    def hearing(self) -> None: ...


class Service:
    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.log = logging.getLogger(f"kvserve.{settings.role}")
        self.nc: NATS | None = None
        self.stopping = asyncio.Event()
        self.reconnects = 0  # times the NATS connection came back: messages sent meanwhile may be lost
        self.started_at = time.time()
        self._tasks: set[asyncio.Task] = set()
        self.failed = False  # an essential task failed: the process exits non-zero
        self.metrics = Metrics(settings.instance_id, settings.role, model_name(settings.model_spec))
        self.metrics.gauge("kvserve_start_time_seconds", "When this process started (Unix time): a restart changes it",
                           ).set(self.started_at)  # fmt: skip
        self._nats_reconnects = self.metrics.counter("kvserve_nats_reconnects_total", "Times the NATS connection came back")
        self.metrics_address: str | None = None  # base URL of /metrics and /healthz, when served
        self.warming = False  # start-up work still runs beside requests (`warm_in_background`)
        self.heard_views: list[HeardView] = []  # told when NATS is lost and back

    @property
    def instance_id(self) -> InstanceId:
        return self.settings.instance_id

    # --- lifecycle ------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        async with AsyncExitStack() as stack:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stopping.set)
                stack.callback(loop.remove_signal_handler, sig)
            await self._serve_metrics(stack)
            self.nc = await self._connect()
            stack.push_async_callback(self._drain)
            await self.subscribe(subjects.metrics(self.instance_id), schema.MetricsRequest, self._on_metrics)
            await self.start(stack)
            stack.push_async_callback(self.stop)
            heap.freeze()  # what start-up built lives as long as the process: out of the GC's passes
            # started: answer roll calls, then call one, so peers already running are seen now
            await self.subscribe(subjects.ROLL_CALL, schema.RollCall, self._on_roll_call)
            await self.publish(subjects.ROLL_CALL, schema.RollCall(instance_id=self.instance_id))
            beat = asyncio.create_task(self._heartbeat_loop())
            stack.callback(beat.cancel)
            if self.settings.heap_trim_s and heap.can_trim():
                trimming = asyncio.create_task(self._trim_heap_loop(self.settings.heap_trim_s))
                stack.callback(trimming.cancel)
            self.log.info("%s ready", self.instance_id)
            await self.stopping.wait()
            self.log.info("%s stopping", self.instance_id)

    async def start(self, stack: AsyncExitStack) -> None:
        """Subscribe and start background work; register cleanups on ``stack``."""

    async def stop(self) -> None:
        """Stop taking work (called before NATS drains)."""

    async def _on_metrics(self, request: schema.MetricsRequest, msg: Msg) -> schema.MetricsReply:
        return schema.MetricsReply(text=self.metrics.exposition())

    async def _serve_metrics(self, stack: AsyncExitStack) -> None:
        """Serve /metrics and /healthz on KVSERVE_METRICS_PORT, when it is set."""
        s = self.settings
        if s.metrics_port is None:
            return
        app = metrics_server.init_app(self.metrics, self.health_problems, self.instance_id)
        runner, self.metrics_address = await metrics_server.serve(app, s.metrics_host, s.metrics_port)
        stack.push_async_callback(runner.cleanup)
        self.log.info("metrics on %s/metrics", self.metrics_address)

    def health_problems(self) -> list[str]:
        """Why this service cannot do its work now; [] when it can."""
        problems = []
        if self.nc is None or not self.nc.is_connected:
            problems.append("not connected to NATS")
        if self.stopping.is_set():
            problems.append("stopping")
        return problems

    async def _on_roll_call(self, request: schema.RollCall, msg: Msg) -> None:
        await self.publish(subjects.heartbeat(self.settings.role, self.instance_id), self.heartbeat())

    def heartbeat(self) -> Heartbeat:
        s = self.settings
        return Heartbeat(instance_id=s.instance_id, role=s.role, host_id=s.host_id, started_at=self.started_at,
                         warming=self.warming)  # fmt: skip

    # --- NATS -----------------------------------------------------------------
    async def _connect(self) -> NATS:
        """Connect, retrying forever (nats-py retries the first connect itself with
        max_reconnect_attempts=-1); give up only if the service is told to stop."""
        failures = refusals = 0

        async def disconnected() -> None:
            for view in self.heard_views:
                view.deaf()
            if not self.stopping.is_set():
                self.log.warning("disconnected from NATS; reconnecting")

        async def reconnected() -> None:
            self.reconnects += 1
            self._nats_reconnects.inc()
            for view in self.heard_views:
                view.hearing()
            where = self.nc.connected_url if self.nc else None
            self.log.info("reconnected to NATS at %s", f"{where.hostname}:{where.port}" if where else "?")
            if self.heard_views:  # every peer beats now, not within a second: the views catch up at once
                self.spawn(self.publish(subjects.ROLL_CALL, schema.RollCall(instance_id=self.instance_id)))

        async def error(e: Exception) -> None:
            nonlocal failures, refusals
            if "permissions violation" in str(e):  # the connection stays up; our user may not do that
                refusals += 1
                if refusals & (refusals - 1) == 0:
                    self.log.error("NATS refused this %s: %s (%d refusals)", self.settings.role, e, refusals)
                return
            failures += 1
            if failures & (failures - 1) == 0:  # 1st, 2nd, 4th, 8th... failure: informative, not a flood
                url = nats_auth.redact_url(self.settings.nats_url)
                self.log.warning("NATS at %s: %s (attempt %d; retrying)", url, e, failures)

        credentials = {}
        if self.settings.nats_credentials is not None:
            credentials = nats_auth.load_credentials(self.settings.nats_credentials).connect_options()
        if self.settings.nats_tls is not None:  # nats-server between hosts: mutual TLS from the cluster CA
            credentials["tls"] = mutual_context(self.settings.nats_tls, server=False)
        connect = asyncio.ensure_future(
            nats.connect(
                nats_auth.server_urls(self.settings.nats_url),  # one, or every server of a NATS cluster
                **credentials,
                # the only replies its user may read
                inbox_prefix=nats_auth.inbox_prefix(self.settings.role, self.instance_id),
                name=self.instance_id,
                max_reconnect_attempts=-1,  # forever, the first connect included
                reconnect_time_wait=0.5,
                **nats_auth.KEEPALIVE,  # a server out of reach is left within seconds
                dont_randomize=self.settings.nats_in_order,
                disconnected_cb=disconnected,
                reconnected_cb=reconnected,
                error_cb=error,
            )
        )
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait([connect, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not connect.done():
            connect.cancel()
            raise SystemExit(0)  # told to stop before NATS was ever reached
        failures = 0
        return connect.result()

    async def _drain(self) -> None:
        """Drain NATS on the way out; close the connection where it cannot drain. Whatever
        NATS is doing (down, reconnecting, gone mid-drain), a stop is no failure: the
        process still exits 0."""
        nc = self.nc
        if nc is None or nc.is_closed:
            return
        if nc.is_connected:
            try:
                await nc.drain()
                return
            except Exception as e:
                self.log.warning("NATS did not drain (%s): closing the connection", e)
        try:
            await nc.close()  # nothing to drain to
        except Exception as e:  # e.g. uvloop refuses to flush into a transport the server already closed
            self.log.info("closed the NATS connection; what it still held is lost (%s)", e)

    async def _trim_heap_loop(self, every_s: float) -> None:
        """Give freed heap memory back to the kernel now and then (libs/common/heap.py)."""
        while True:
            await asyncio.sleep(every_s)
            await asyncio.to_thread(heap.trim)

    async def _heartbeat_loop(self) -> None:
        subject = subjects.heartbeat(self.settings.role, self.instance_id)
        while True:
            try:
                await self.nc.publish(subject, schema.encode(self.heartbeat()))
            except Exception as e:  # never let a heartbeat failure end the loop
                self.log.warning("heartbeat not sent: %s", e)
            await asyncio.sleep(self.settings.heartbeat_interval)

    async def subscribe_heartbeats(self, role: str | None, handler: Handler) -> None:
        """Handle the heartbeats of every instance of ``role`` (None: of every role), each only
        if it came on its sender's own subject (one in another instance's name is dropped)."""

        async def believed(beat: Heartbeat, msg: Msg) -> None:
            if not subjects.names_sender(msg.subject, beat.role, beat.instance_id):
                self.log.warning("dropped a heartbeat on %s that claims to be %s's", msg.subject, beat.instance_id)
                return
            await handler(beat, msg)

        await self.subscribe(subjects.HEARTBEAT_ALL if role is None else subjects.heartbeats(role), Heartbeat, believed)

    async def subscribe(self, subject: str, kind: type[M], handler: Handler, queue: str = "") -> None:
        """Handle every ``kind`` message on ``subject`` in its own task; reply with
        what the handler returns when the sender asked for a reply."""

        async def on_message(msg: Msg) -> None:
            self.spawn(self._handle(msg, kind, handler))

        await self.nc.subscribe(subject, queue=queue, cb=on_message)

    async def _handle(self, msg: Msg, kind: type[M], handler: Handler) -> None:
        try:
            message = schema.decode(msg.data, kind)
        except BadMessageError as e:
            self.log.warning("dropped a message on %s: %s", msg.subject, e)
            await self._reply(msg, ErrorReply(code=ErrorCode.BAD_MESSAGE, message=str(e)))
            return
        try:
            reply = await handler(message, msg)
        except Exception as e:
            self.log.exception("handler for %s failed", msg.subject)
            reply = ErrorReply(code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}")
        if reply is not None:
            await self._reply(msg, reply)

    async def _reply(self, msg: Msg, reply: Message) -> None:
        if msg.reply:
            try:
                await msg.respond(schema.encode(reply))
            except Exception as e:
                self.log.warning("reply on %s not sent: %s", msg.subject, e)

    async def request(self, subject: str, message: Message, kind: type[M], timeout: float = 5.0) -> M | ErrorReply:
        """Request/reply: the ``kind`` reply, or the peer's ErrorReply; raises
        BadMessageError when the answer is neither."""
        reply = await self.nc.request(subject, schema.encode(message), timeout=timeout)
        return schema.decode_reply(reply.data, kind)

    async def publish(self, subject: str, message: Message) -> None:
        await self.nc.publish(subject, schema.encode(message))

    def warm_in_background(self, work: Callable[[], object]) -> asyncio.Task:
        """Run blocking start-up work (importing a library, building tables) in a thread, so
        it does not hold up readiness. Until it ends, the heartbeats say ``warming``: it
        shares this process's cores with the requests served meanwhile, so their times are
        no sample of how fast the instance runs (the conductor learns nothing from them)."""
        self.warming = True

        async def warm() -> None:
            try:
                await asyncio.to_thread(work)
            finally:
                self.warming = False

        return self.spawn(warm())

    def spawn(self, coro: Awaitable, essential: bool = False) -> asyncio.Task:
        """Run ``coro`` in a task that is kept alive and whose failure is logged. An
        ``essential`` one is the service's work itself (an engine loop, an expiry loop):
        if it fails, the process stops and exits non-zero, so that its supervisor starts
        it again, rather than living on without it."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda task: self._task_done(task, essential))
        return task

    def _task_done(self, task: asyncio.Task, essential: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if not essential:
            self.log.error("background task failed", exc_info=task.exception())
            return
        self.log.critical("%s failed: stopping, to be started again", task.get_coro().__qualname__,
                          exc_info=task.exception())  # fmt: skip
        self.failed = True
        self.stopping.set()


def configure_logging(instance_id: InstanceId, level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {instance_id} %(name)s: %(message)s",
    )


def run_service(service: Service) -> None:
    """The one place a service process enters asyncio: with uvloop when available."""
    try:
        import uvloop
    except ImportError:
        with asyncio.Runner(loop_factory=short_tls_shutdown(asyncio.SelectorEventLoop)) as runner:
            runner.run(service.run())
    else:
        uvloop.run(service.run(), loop_factory=short_tls_shutdown(uvloop.Loop))
    if service.failed:
        sys.exit(EXIT_FAILED)


def short_tls_shutdown(loop_class: type[asyncio.AbstractEventLoop]) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of ``loop_class`` loops whose ``start_tls`` waits at most `TLS_SHUTDOWN_TIMEOUT_S`
    for a closed connection's shutdown, unless its caller says otherwise."""

    class Loop(loop_class):
        async def start_tls(self, *args, ssl_shutdown_timeout: float | None = None, **kwargs):
            timeout = TLS_SHUTDOWN_TIMEOUT_S if ssl_shutdown_timeout is None else ssl_shutdown_timeout
            return await super().start_tls(*args, ssl_shutdown_timeout=timeout, **kwargs)

    return Loop
