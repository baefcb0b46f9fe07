"""The gateway service and its lifecycle: an aiohttp server on top of the NATS service base.

`Gateway` loads the served model, follows every instance's heartbeat, serves
the HTTP application (routes.py) on its listener, and reports its URL and load
in its own heartbeat. Running a request is the request core's (generation.py).
"""

import asyncio
import ipaddress
import socket
from contextlib import AsyncExitStack

import msgspec
from nats.aio.msg import Msg

from libs.common.peers import PeerDirectory
from libs.common.service import Service
from libs.protocol.schema import GatewayBeat, Heartbeat
from libs.protocol.slo import SLO
from services.gateway.generation import Generations
from services.gateway.listener import ConnectionGuard, serve
from services.gateway.request_metrics import RequestMetrics
from services.gateway.routes import init_app
from services.gateway.served_model import ServedModel
from services.gateway.settings import GatewaySettings

# seconds the HTTP handlers still running get once the drain is over (`stop`): the
# generations have ended by then; this bounds any other (a /metrics scrape, a console page)
HANDLERS_GRACE = 2.0


class Gateway(Service):
    settings: GatewaySettings

    def __init__(self, settings: GatewaySettings, model: ServedModel | None = None) -> None:
        super().__init__(settings)
        self.address: str | None = None  # base URL, e.g. http://127.0.0.1:8000, once listening
        self.peers = PeerDirectory()  # every live instance: for readiness, worker liveness and /metrics
        self.heard_views.append(self.peers)
        self._generations = None if model is None else Generations(self, settings, self.peers, model)
        self.request_metrics = RequestMetrics(self.metrics, SLO(settings.slo_ttft_s, settings.slo_tbt_s))

    @property
    def generations(self) -> Generations:
        """The request core; there once the model is (given, or loaded by `start`)."""
        if self._generations is None:
            raise RuntimeError("the gateway has no model yet: `start` loads it")
        return self._generations

    @property
    def num_in_flight(self) -> int:
        return 0 if self._generations is None else self._generations.num_in_flight

    async def start(self, stack: AsyncExitStack) -> None:
        s = self.settings
        if self._generations is None:
            model = await asyncio.to_thread(ServedModel.load, s.model, s.block_size, s.max_model_len)
            self._generations = Generations(self, s, self.peers, model)
        await self.subscribe_heartbeats(None, self._on_heartbeat)
        await self.generations.tenants.watch(stack)  # a changed tenants file (or SIGHUP): read again
        guard = ConnectionGuard(s.header_timeout, s.keepalive_timeout, s.max_connections)
        app = init_app(self, self.generations, guard)
        self.generations.observers.append(self.request_metrics.observe)  # told of every request once it is over
        runner = await serve(app, s.host, s.port, guard, shutdown_timeout=HANDLERS_GRACE)
        stack.push_async_callback(runner.cleanup)
        port = runner.addresses[0][1]
        self.address = f"http://{_url_host(s.host)}:{port}"
        self.log.info("OpenAI-compatible API on %s/v1 (model %s)", self.address, self.generations.model.model_id)

    async def stop(self) -> None:
        """Drain before the listener closes: new requests get 503 ``shutting_down``, those in
        flight have KVSERVE_GATEWAY_DRAIN_TIMEOUT seconds to finish, then end with that error."""
        if self._generations is not None:
            await self._generations.drain(self.settings.drain_timeout)

    def heartbeat(self) -> Heartbeat:
        return msgspec.structs.replace(super().heartbeat(), address=self.address,
                                       payload=GatewayBeat(load=self.num_in_flight))  # fmt: skip

    async def _on_heartbeat(self, heartbeat: Heartbeat, msg: Msg) -> None:
        self.peers.observe(heartbeat)


def _url_host(host: str) -> str:
    """The host part of the URL clients should use for a listener bound to ``host``."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()  # bound to every interface: advertise this machine's name
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        return host
    return f"[{host}]" if is_v6 else host
