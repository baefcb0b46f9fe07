"""The live web console at ``/console``: the page and its files, the state as JSON,
and a live feed of it as server-sent events (one event a second, or sooner when a
request ends).

The page and its static files hold no data and are public; the data routes
(``/console/api/*``) need the API key when one is set. The page asks for the key
once, keeps it in the tab's sessionStorage and sends it as a Bearer header on its
fetches (the feed too: it is read with fetch, not EventSource), so the key is
never in a URL, a cookie or a log line. The tenants table is every tenant's for
an admin's key, the caller's own row for any other tenant's. What the console shows is built in
console_data.py; this module only gathers it (the conductors' views over NATS)
and serves it.
"""

import asyncio
import functools
import logging
import mimetypes
import time
from dataclasses import replace
from importlib import resources
from typing import Any

import msgspec
from aiohttp import web
from nats.errors import Error as NatsError

from libs.common.service import Service
from libs.protocol import subjects
from libs.protocol.schema import BadMessageError, ConductorViewReply, ConductorViewRequest
from libs.protocol.vocabulary import Role
from services.gateway import sse
from services.gateway.console_data import RequestLog, console_state, for_caller
from services.gateway.errors import error_body
from services.gateway.generation import Generations
from services.gateway.tenancy import TENANT

log = logging.getLogger("kvserve.gateway.console")

STATIC_PACKAGE = "services.gateway.console_static"
VIEW_TIMEOUT = 1.0  # seconds a conductor gets to answer the console
VIEW_MAX_AGE = 0.9  # the conductors' views are asked for at most this often, whoever asks
FEED_PERIOD = 1.0  # seconds between two events of the live feed when nothing else happens
FEED_MIN_GAP = 0.25  # ... and at least this between two events, however many requests end
INLINE_STATE_REQUESTS = 2_000  # with more requests in the log, the state is built off the event loop
MAX_DECISIONS = 20


def _static_names() -> frozenset[str]:
    """Every file of the console's static folder, as a path relative to it."""
    names, folders = set(), [(resources.files(STATIC_PACKAGE), "")]
    while folders:
        folder, prefix = folders.pop()
        for entry in folder.iterdir():
            if entry.is_dir() and entry.name != "__pycache__":
                folders.append((entry, f"{prefix}{entry.name}/"))
            elif entry.is_file() and entry.name != "__init__.py" and not entry.name.endswith(".pyc"):
                names.add(prefix + entry.name)
    return frozenset(names)


STATIC_NAMES = _static_names()
# Served without the API key: the page and its files, none of which holds data.
PUBLIC_PATHS = frozenset({"/console", *(f"/console/static/{name}" for name in STATIC_NAMES)})


class Console:
    """The console of one gateway: ``service`` is its NATS side, ``generations`` its
    request core, whose finished requests it logs."""

    def __init__(self, service: Service, generations: Generations, requests: RequestLog | None = None) -> None:
        self.service = service
        self.generations = generations
        self.requests = requests or RequestLog()
        generations.observers.append(self.requests.observe)
        self._views: tuple[float, list[ConductorViewReply], list[str]] = (float("-inf"), [], [])
        self._views_lock = asyncio.Lock()
        self._files: dict[str, bytes] = {}
        self._built: tuple[float, int, dict[str, Any]] | None = None  # (when, log version, state), for every page
        self._build_lock = asyncio.Lock()

    # --- the data ----------------------------------------------------------------------
    async def state(self) -> dict[str, Any]:
        """The state every page and `kvserve status` get: built once for all of them while
        no request ends (for up to FEED_MIN_GAP), off the event loop when the log is long."""
        async with self._build_lock:
            views, unreachable = await self._conductor_views()
            version = self.requests.version
            if self._built is not None and self._built[1] == version and time.monotonic() - self._built[0] < FEED_MIN_GAP:
                return self._built[2]
            now = time.time()
            gateway = {
                "instance_id": self.service.instance_id, "model": self.generations.model.model_id,
                "in_flight": self.generations.num_in_flight, "uptime_s": round(now - self.service.started_at, 3),
            }  # fmt: skip
            served = self.requests.recent()
            usage = self.generations.usage
            totals = {name: replace(t, refusals=dict(t.refusals)) for name, t in usage.totals.items()}  # a snapshot
            args = (gateway, self.generations.peers.heard(), views, unreachable, served, now, MAX_DECISIONS)
            kwargs = {"usage": totals, "tenant_label": usage.label}
            if len(served) > INLINE_STATE_REQUESTS:
                state = await asyncio.to_thread(functools.partial(console_state, *args, **kwargs))
            else:
                state = console_state(*args, **kwargs)
            self._built = (time.monotonic(), version, state)
            return state

    async def _conductor_views(self) -> tuple[list[ConductorViewReply], list[str]]:
        """Every live conductor's view, asked at most every VIEW_MAX_AGE seconds
        (however many pages watch), and the conductors that did not answer."""
        async with self._views_lock:
            asked_at, views, unreachable = self._views
            if time.monotonic() - asked_at < VIEW_MAX_AGE:
                return views, unreachable
            conductors = [hb.instance_id for hb in self.generations.peers.alive(Role.CONDUCTOR)]
            answers = await asyncio.gather(*(self._ask(c) for c in conductors))
            views = [a for a in answers if a is not None]
            unreachable = [c for c, a in zip(conductors, answers) if a is None]
            self._views = (time.monotonic(), views, unreachable)
            return views, unreachable

    async def _ask(self, conductor_id: str) -> ConductorViewReply | None:
        request = ConductorViewRequest(max_decisions=MAX_DECISIONS)
        try:
            reply = await self.service.request(
                subjects.conductor_view(conductor_id), request, ConductorViewReply, VIEW_TIMEOUT
            )
        except (NatsError, BadMessageError, TimeoutError) as e:
            log.debug("no view from %s: %s", conductor_id, e)
            return None
        return reply if isinstance(reply, ConductorViewReply) else None

    # --- the routes ----------------------------------------------------------------------
    async def page(self, request: web.Request) -> web.Response:
        return await self._file("index.html")

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC_NAMES:
            raise web.HTTPNotFound()
        return await self._file(name)

    async def caller_state(self, request: web.Request) -> dict[str, Any]:
        """The state as the request's tenant may see it (console_data.for_caller)."""
        return for_caller(await self.state(), request.get(TENANT), self.generations.usage.totals,
                          self.requests.recent())  # fmt: skip

    async def state_json(self, request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(await self.caller_state(request)),
                            content_type="application/json", headers={"Cache-Control": "no-store"})  # fmt: skip

    async def events(self, request: web.Request) -> web.StreamResponse:
        """The state as server-sent events: one a second, sooner when a request ends;
        the stream ends when the client leaves or the gateway stops. Only for a client
        that asks for an event stream: any other gets 406 at once, not an endless body."""
        if "text/event-stream" not in request.headers.get("Accept", ""):
            message = "This route streams server-sent events: ask for them with Accept: text/event-stream."
            body = error_body(message, "invalid_request_error", None, "not_acceptable")
            return web.Response(body=msgspec.json.encode(body), status=406, content_type="application/json")
        stream = await sse.open_stream(request, {})
        stopping = self.service.stopping
        try:
            while not stopping.is_set():
                await stream.write(sse.event(await self.caller_state(request)))
                next_at = time.monotonic() + FEED_PERIOD
                await self._wait(stopping, FEED_MIN_GAP)
                if not stopping.is_set():
                    await self.requests.wait_changed(max(next_at - time.monotonic(), 0.0))
        except ConnectionResetError:
            pass  # the page was closed
        return stream

    @staticmethod
    async def _wait(event: asyncio.Event, seconds: float) -> None:
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            pass

    async def _file(self, name: str) -> web.Response:
        body = self._files.get(name)
        if body is None:
            body = self._files[name] = await asyncio.to_thread(resources.files(STATIC_PACKAGE).joinpath(name).read_bytes)
        content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        return web.Response(body=body, content_type=content_type, headers={"Cache-Control": "no-cache"})


def add_routes(app: web.Application, service: Service, generations: Generations) -> Console:
    """Serve the console on ``app``: the page, its files, the state and its live feed."""
    console = Console(service, generations)
    app.router.add_get("/console", console.page)
    app.router.add_get("/console/static/{name:.+}", console.static)
    app.router.add_get("/console/api/state", console.state_json)
    app.router.add_get("/console/api/events", console.events)
    return console
