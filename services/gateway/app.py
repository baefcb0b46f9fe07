"""The gateway service: an aiohttp server on top of the NATS service base.

`Gateway` owns the served model and the HTTP listener, reports its URL and load
in its heartbeat, and runs one request through the cluster (`generate`);
`init_app` builds the aiohttp application its handlers live in.
"""

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import msgspec
from aiohttp import web

from libs.common import subjects
from libs.common.metrics import REGISTRY, merge_by_instance
from libs.common.model.hashing import BlockHash, block_hashes, model_extra
from libs.common.peers import PeerDirectory
from libs.common.schema import Heartbeat, MetricsReply, MetricsRequest
from libs.common.service import Service
from services.gateway import handlers
from services.gateway.dispatch import RequestRun, SLOOverride
from services.gateway.migration import MigratingRun
from services.gateway.errors import ModelNotServedError
from services.gateway.generation import Delta, TextStream, stream_deltas
from services.gateway.listener import ConnectionGuard, serve
from services.gateway.openai_protocol import GenerateRequest, Usage
from services.gateway.served_model import PreparedRequest, ServedModel
from services.gateway.settings import GatewaySettings
from services.gateway.worker_watch import LOST_AFTER_HEARTBEATS, WorkerWatch

SHUTDOWN_GRACE = 10.0  # seconds in-flight requests get to finish on SIGTERM
INLINE_HASH_TOKENS = 2048  # longer prompts are hashed off the event loop
ROLES = ("conductor", "store", "prefill", "decode", "gateway")


@dataclass
class Generation:
    """One admitted request: where it runs (moving when a worker dies) and the
    text it has produced so far."""

    run: MigratingRun
    text: TextStream

    def deltas(self) -> AsyncIterator[Delta]:
        return stream_deltas(self.run, self.text)

    def usage(self) -> Usage:
        return Usage(self.text.num_prompt_tokens, self.text.num_completion_tokens, self.text.num_cached_tokens)

    def served_by(self) -> dict:
        """Which instances served it and how often it moved, for its last chunk or body."""
        return self.run.served_by()


class Gateway(Service):
    settings: GatewaySettings

    def __init__(self, settings: GatewaySettings, model: ServedModel | None = None) -> None:
        super().__init__(settings)
        self.model = model  # loaded in `start` when not given
        self.address: str | None = None  # base URL, e.g. http://127.0.0.1:8000, once listening
        self.num_in_flight = 0
        self.peers = PeerDirectory()  # every live instance, for /metrics

    async def start(self, stack: AsyncExitStack) -> None:
        s = self.settings
        if self.model is None:
            self.model = await asyncio.to_thread(ServedModel.load, s.model, s.block_size, s.max_model_len)
        await self.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self._on_heartbeat)
        guard = ConnectionGuard(s.header_timeout, s.keepalive_timeout, s.max_connections)
        runner = await serve(init_app(self, guard), s.host, s.port, guard, shutdown_timeout=SHUTDOWN_GRACE)
        stack.push_async_callback(runner.cleanup)
        port = runner.addresses[0][1]
        self.address = f"http://{_url_host(s.host)}:{port}"
        self.log.info("OpenAI-compatible API on %s/v1 (model %s)", self.address, self.model.model_id)

    def heartbeat(self) -> Heartbeat:
        return msgspec.structs.replace(super().heartbeat(), address=self.address or "", load=self.num_in_flight)

    async def _on_heartbeat(self, heartbeat: Heartbeat, msg) -> None:
        self.peers.observe(heartbeat)

    async def cluster_metrics(self) -> str:
        """Every live instance's metrics (asked over NATS, in parallel), labelled by instance."""
        others = [hb.instance_id for role in ROLES for hb in self.peers.alive(role) if hb.instance_id != self.instance_id]

        async def ask(instance_id: str) -> str:
            try:
                reply = await self.request(subjects.metrics(instance_id), MetricsRequest(), MetricsReply, timeout=2.0)
                return reply.text
            except Exception as e:  # one silent instance must not hide the others
                self.log.warning("no metrics from %s: %s", instance_id, e)
                return ""

        texts = dict(zip(others, await asyncio.gather(*(ask(i) for i in others))))
        return merge_by_instance({self.instance_id: REGISTRY.render(), **texts})

    @asynccontextmanager
    async def generate(
        self, request: GenerateRequest, request_id: str, slo: SLOOverride | None = None
    ) -> AsyncIterator[Generation]:
        """Admit ``request`` and start it on the cluster; inside the block, read its
        text. A worker that dies under it moves it (at most ``max_attempts`` tries
        in all); leaving the block early (an error, a disconnect) cancels it."""
        model, s = self.model, self.settings
        if request.model != model.model_id:
            raise ModelNotServedError(request.model)
        prepared = await model.prepare(request, request_id)
        text = TextStream(model.tokenizer, prepared.sampling, model.max_model_len, prepared.num_prompt_tokens)
        silence = LOST_AFTER_HEARTBEATS * s.heartbeat_interval

        def attempt(p: PreparedRequest, exclude: frozenset[str]) -> RequestRun:
            watch = WorkerWatch(self.peers, silence)
            return RequestRun(self, p, s.request_timeout, slo=slo, exclude=exclude, watch=watch)

        self.num_in_flight += 1
        try:
            async with MigratingRun(prepared, attempt, self._block_hashes, s.max_attempts) as run:
                yield Generation(run, text)
        finally:
            self.num_in_flight -= 1

    async def _block_hashes(self, token_ids: list[int]) -> list[BlockHash]:
        """The block hashes of a prompt, as the workers name its KV blocks."""
        model = self.model
        if len(token_ids) > INLINE_HASH_TOKENS:
            return await asyncio.to_thread(block_hashes, token_ids, model.block_size, model_extra(model.model_id))
        return block_hashes(token_ids, model.block_size, model_extra(model.model_id))


def init_app(gateway: Gateway, guard: ConnectionGuard | None = None) -> web.Application:
    """The gateway's routes; ``guard``, when given, watches every request first."""
    middlewares = [handlers.error_middleware, handlers.auth_middleware]
    app = web.Application(middlewares=([guard.middleware] if guard else []) + middlewares)
    app[handlers.GATEWAY] = gateway
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model}", handlers.get_model)
    app.router.add_get("/health", handlers.health_ready)  # vLLM's meaning: 200 only when requests can be served
    app.router.add_get("/health/ready", handlers.health_ready)
    app.router.add_get("/health/live", handlers.health_live)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/openapi.json", handlers.openapi)
    return app


def _url_host(host: str) -> str:
    """The host part of the URL clients should use for a listener bound to ``host``."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()  # bound to every interface: advertise this machine's name
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        return host
    return f"[{host}]" if is_v6 else host
