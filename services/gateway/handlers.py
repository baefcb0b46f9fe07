"""The HTTP layer: route handlers and middlewares.

The only place domain errors become HTTP statuses and OpenAI error bodies
(through `errors.to_http`); everything a handler does beyond that is the
request core's (`generation.Generations`). `Handlers` holds what the handlers
share; routes.py binds its methods to paths.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import msgspec
from aiohttp import web

from libs.common.service import Service
from libs.protocol.errors import KVServeError
from libs.protocol.slo import SLOOverride
from libs.protocol.vocabulary import KVTier, Role
from services.gateway import console
from services.gateway import openapi as openapi_document
from services.gateway import sse
from services.gateway.cluster_metrics import cluster_metrics
from services.gateway.errors import (
    InvalidParameterError,
    ModelNotServedError,
    RequestBodyTimeoutError,
    error_body,
    to_http,
)
from services.gateway.generation import Generation, Generations
from services.gateway.logprobs import LogprobsBodies
from services.gateway.migration import MigratingRun
from services.gateway.openai_protocol import GenerateRequest, parse_chat_request, parse_completion_request
from services.gateway.request_limits import content_codings, decode_body, decode_content
from services.gateway.response_bodies import Choice, ResponseBodies, model_card, model_list
from services.gateway.tenancy import TENANT
from services.gateway.text_stream import Delta
from services.gateway.tools import ToolUse

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger("kvserve.gateway.http")

PUBLIC_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/openapi.json"}) | console.PUBLIC_PATHS  # no API key needed
READY_ROLES = (Role.CONDUCTOR, Role.PREFILL, Role.DECODE)  # a request needs a live instance of each
INLINE_DECODE_BYTES = 64 * 1024  # larger bodies are decoded off the event loop


class Handlers:
    """The route handlers and the auth middleware of one gateway: ``service`` is its
    NATS side (its instance, its connection), ``generations`` its request core."""

    def __init__(self, service: Service, generations: Generations) -> None:
        self.service = service
        self.generations = generations
        self.settings = generations.settings

    # --- generation -----------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat_request, "chatcmpl")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion_request, "cmpl")

    async def _generate(
        self, request: web.Request, parse: Callable[[Any], GenerateRequest], id_prefix: str
    ) -> web.StreamResponse:
        parsed = parse(await _json_body(request, self.settings.body_timeout))
        slo = _slo_override(request)
        session_id = _session_id(request, parsed)
        response_id = f"{id_prefix}-{uuid.uuid4().hex}"
        model = self.generations.model
        bodies = ResponseBodies(response_id, model.model_id, parsed.is_chat, parsed.include_usage)
        logprobs = None  # one per choice, when asked for
        if parsed.logprobs is not None:
            logprobs = [LogprobsBodies(model.tokenizer, parsed.is_chat) for _ in range(parsed.n)]
        stream: web.StreamResponse | None = None
        try:
            tenant = request.get(TENANT)
            async with self.generations.generate(parsed, response_id, slo, session_id, tenant) as generation:
                headers = {"x-request-id": response_id, **_explanation_headers(generation.run),
                           **generation.ratelimit_headers}  # fmt: skip
                if not parsed.stream:
                    return await _complete(generation, bodies, headers, logprobs, parsed.tool_use)
                stream = await sse.open_stream(request, headers)
                await _write_events(stream, generation, bodies, logprobs, parsed.tool_use)
                return stream
        except ConnectionResetError:
            if stream is None:
                raise
            return stream  # the client left mid-stream; leaving the run cancelled the workers

    async def usage(self, request: web.Request) -> web.Response:
        """What the caller's own tenant has used of this gateway since it started, and its limits."""
        tenant, generations = request[TENANT], self.generations
        limits = {k: v for k, v in vars(tenant.quotas).items() if v is not None}
        body = {"object": "usage", "tenant": tenant.name, "since": int(self.service.started_at),
                **generations.usage.of(tenant), "in_flight": generations.quotas.in_flight(tenant.name),
                "limits": limits}  # fmt: skip
        return _json_response(body)

    # --- models, health, metrics, the API description ------------------------------
    async def list_models(self, request: web.Request) -> web.Response:
        model = self.generations.model
        return _json_response(model_list(model.model_id, int(self.service.started_at), model.max_model_len))

    async def get_model(self, request: web.Request) -> web.Response:
        model = self.generations.model
        if request.match_info["model"] != model.model_id:
            raise ModelNotServedError(request.match_info["model"])
        return _json_response(model_card(model.model_id, int(self.service.started_at), model.max_model_len))

    async def health_live(self, request: web.Request) -> web.Response:
        """200 while the process serves HTTP at all."""
        return _json_response({"status": "ok", **self._instance_facts()})

    async def health_ready(self, request: web.Request) -> web.Response:
        """200 when a request can be served now; else 503 with the reasons it cannot."""
        nc = self.service.nc
        reasons = []
        if nc is None or not nc.is_connected:
            reasons.append("not connected to NATS")
        peers = self.generations.peers
        # a conductor that prefills on decode workers (local_prefill, or a cluster that never had a prefill
        # worker) serves without one
        local = any(beat.prefills_on_decode for beat in peers.alive(Role.CONDUCTOR))
        needed = [role for role in READY_ROLES if not (role == Role.PREFILL and local)]
        reasons += [f"no live {role} instance" for role in needed if not peers.alive(role)]
        if reasons:
            body = {"status": "unavailable", "reasons": reasons, **self._instance_facts()}
            return _json_response(body, status=503)
        return _json_response({"status": "ok", **self._instance_facts()})

    def _instance_facts(self) -> dict[str, Any]:
        return {
            "instance_id": self.service.instance_id,
            "model": self.generations.model.model_id,
            "in_flight": self.generations.num_in_flight,
            "uptime_s": round(time.time() - self.service.started_at, 3),
        }

    async def metrics(self, request: web.Request) -> web.Response:
        """The whole cluster's metrics in the Prometheus text format, one ``instance`` label per process."""
        text = await cluster_metrics(self.service, self.generations.peers)
        return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI 3 description of every route."""
        model_id = self.generations.model.model_id
        body = openapi_document.document_bytes(model_id, self.generations.tenants.needs_key)
        return web.Response(body=body, content_type="application/json")

    # --- the middleware that needs the settings -------------------------------------
    @web.middleware
    async def auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """With API keys configured (one, or a tenants file), every route but the health
        probes and the API description needs ``Authorization: Bearer <key>``: the key
        names the request's tenant (401 for an unknown key, 403 for a disabled tenant)."""
        if request.path not in PUBLIC_PATHS:
            request[TENANT] = self.generations.tenants.authenticate(_header(request, "Authorization"))
        return await handler(request)


# --- writing a generation --------------------------------------------------------------
async def _complete(generation: Generation, bodies: ResponseBodies, headers: dict[str, str],
                    logprobs: list[LogprobsBodies] | None, tool_use: ToolUse | None = None) -> web.Response:  # fmt: skip
    n = len(generation.texts)
    pieces: list[list[str]] = [[] for _ in range(n)]
    finish_reasons: list[str | None] = [None] * n
    token_ids: list[list[int]] = [[] for _ in range(n)]
    token_logprobs: list[list] = [[] for _ in range(n)]
    async with aclosing(generation.deltas()) as deltas:
        async for delta in deltas:
            c = delta.choice
            pieces[c].append(delta.text)
            finish_reasons[c] = delta.finish_reason or finish_reasons[c]
            token_ids[c] += delta.token_ids
            token_logprobs[c] += delta.logprobs or []
    choices = [Choice("".join(pieces[c]), finish_reasons[c],
                      logprobs[c].body(token_ids[c], token_logprobs[c]) if logprobs is not None else None)
               for c in range(n)]  # fmt: skip
    if tool_use is not None:
        choices = [_with_calls(choice, tool_use) for choice in choices]
    body = bodies.completion_of(choices, generation.usage())
    body["kvserve"] = generation.served_by()  # the headers name the first instances; a migration moves it
    if generation.run.ttft_s is not None:
        headers["x-kvserve-actual-ttft-ms"] = f"{generation.run.ttft_s * 1e3:.1f}"
    return _json_response(body, headers=headers)


SLO_HEADERS = {"x-kvserve-slo-ttft-ms": "ttft_s", "x-kvserve-slo-tbt-ms": "tbt_s"}
SLO_MODE_HEADER = "x-kvserve-slo"  # "best-effort": no SLO; served only in time SLO work does not need


def _slo_override(request: web.Request) -> SLOOverride:
    """Per-request SLOs from the x-kvserve-slo-ttft-ms / x-kvserve-slo-tbt-ms headers."""
    values = {}
    for header, field in SLO_HEADERS.items():
        raw = _header(request, header)
        if raw is None:
            continue
        try:
            ms = float(raw)
        except ValueError:
            ms = float("nan")
        if not ms > 0 or ms == float("inf"):
            raise InvalidParameterError(f"{header} must be a positive number of milliseconds, got {raw!r}")
        values[field] = ms / 1e3
    mode = request.headers.get(SLO_MODE_HEADER)
    if mode is not None:
        if mode.strip().lower() != "best-effort":
            raise InvalidParameterError(f"{SLO_MODE_HEADER} must be 'best-effort', got {mode!r}")
        values["best_effort"] = True
    return SLOOverride(**values)


SESSION_HEADER = "x-session-id"
MAX_SESSION_ID = 256


def _session_id(request: web.Request, parsed: GenerateRequest) -> str | None:
    """The conversation a request belongs to: the x-session-id header, else OpenAI's ``user``."""
    session = _header(request, SESSION_HEADER) or parsed.user
    if session is not None and len(session) > MAX_SESSION_ID:
        raise InvalidParameterError(f"the session id ({SESSION_HEADER} or 'user') must be at most "
                                    f"{MAX_SESSION_ID} characters, got {len(session)}")  # fmt: skip
    return session


def _explanation_headers(run: MigratingRun) -> dict[str, str]:
    """Which instances serve the request and what the conductor predicted for it."""
    headers = {
        "x-kvserve-prefill-instance": run.prefill_id or "",
        "x-kvserve-decode-instance": run.decode_id or "",
    }
    admission = run.admission
    if admission is not None:
        if admission.prefill_on_decode:
            headers["x-kvserve-prefill-on-decode"] = "1"
        if admission.predicted_ttft_s is not None:
            headers["x-kvserve-predicted-ttft-ms"] = f"{admission.predicted_ttft_s * 1e3:.1f}"
        tiers = tuple(KVTier)
        headers["x-kvserve-cached-tokens"] = ",".join(f"{t}={admission.cached_tokens.get(t, 0)}" for t in tiers)
    return headers


def _with_calls(choice: Choice, tool_use: ToolUse) -> Choice:
    """``choice`` with the tool calls its text makes, if any (finish_reason "tool_calls")."""
    content, calls = tool_use.parse(choice.text)
    if not calls:
        return choice
    return replace(choice, text=content, finish_reason="tool_calls", tool_calls=[c.body() for c in calls])


async def _write_events(stream: web.StreamResponse, generation: Generation, bodies: ResponseBodies,
                        logprobs: list[LogprobsBodies] | None = None, tool_use: ToolUse | None = None) -> None:  # fmt: skip
    """Write the request's chunks as they come, each with its choice's index (and the
    logprobs of the tokens it came with, when asked for). A failure after the first byte
    (the status line has gone out) releases the text not shown yet, then becomes
    an error event and a last chunk with finish_reason "error"; whatever happens
    short of a lost client, the stream ends with [DONE]. With tools, a choice's text
    is held until it ends, then sent as its tool calls (each whole, in one
    delta.tool_calls chunk) or else as its text."""
    n = len(generation.texts)
    finish_written = [False] * n
    held = [_Held() for _ in range(n)]  # with tools: each choice's text so far
    try:
        if bodies.is_chat:
            for index in range(n):
                await stream.write(sse.event(bodies.role_chunk(index)))
        async with aclosing(generation.deltas()) as deltas:
            async for delta in deltas:
                c = delta.choice
                if tool_use is not None:
                    delta = held[c].add(delta)
                    if delta.finish_reason is None:
                        continue
                lp_body = None
                if logprobs is not None and delta.logprobs:
                    lp_body = logprobs[c].body(delta.token_ids, delta.logprobs)
                if delta.finish_reason is not None:  # the last text rides with the finish, even when empty
                    finish_written[c] = True
                    reason, text = delta.finish_reason, delta.text
                    if tool_use is not None:
                        text, calls = tool_use.parse(delta.text)
                        if calls:
                            reason = "tool_calls"
                            if text:
                                await stream.write(sse.event(bodies.text_chunk(text, index=c)))
                                text = ""
                            calls_chunk = bodies.tool_calls_chunk([call.body(i) for i, call in enumerate(calls)], c)
                            await stream.write(sse.event(calls_chunk))
                    await stream.write(sse.event(_last_chunk(bodies, reason, generation, text, lp_body, c)))
                elif delta.text or lp_body is not None:
                    await stream.write(sse.event(bodies.text_chunk(delta.text, lp_body, c)))
    except ConnectionResetError:
        raise  # the client is gone: nothing more to write
    except Exception as e:
        if isinstance(e, KVServeError):
            log.warning("%s failed mid-stream: %s", bodies.id, e)
        else:
            log.exception("%s failed mid-stream", bodies.id)
        for c, text in enumerate(generation.texts):
            rest = text.fail().text if text.finish_reason is None else ""
            if not finish_written[c] and (rest := held[c].text + rest):
                await stream.write(sse.event(bodies.text_chunk(rest, index=c)))
        await stream.write(sse.event(to_http(e).body))
        for c, written in enumerate(finish_written):
            if not written:
                await stream.write(sse.event(_last_chunk(bodies, "error", generation, index=c)))
    if bodies.include_usage:
        await stream.write(sse.event(bodies.usage_chunk(generation.usage())))
    await stream.write(sse.DONE)
    await stream.write_eof()


class _Held:
    """A choice's deltas held back until it ends (a stream with tools)."""

    def __init__(self) -> None:
        self.text = ""
        self._token_ids: list[int] = []
        self._logprobs: list = []

    def add(self, delta: Delta) -> Delta:
        """``delta`` held; once it is the last, all of them as one."""
        self.text += delta.text
        self._token_ids += delta.token_ids
        self._logprobs += delta.logprobs or []
        if delta.finish_reason is None:
            return delta
        return replace(delta, text=self.text, token_ids=self._token_ids, logprobs=self._logprobs or None)


def _last_chunk(bodies: ResponseBodies, finish_reason: str, generation: Generation, text: str = "",
                logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:  # fmt: skip
    """The chunk with a choice's last text and its finish reason, saying which instances served the request."""
    return {**bodies.finish_chunk(finish_reason, text, logprobs, index), "kvserve": generation.served_by()}


def _header(request: web.Request, name: str) -> str | None:
    """The value of header ``name``; 400 when its bytes are not UTF-8 (aiohttp hands
    them on as surrogates, which nothing downstream can encode)."""
    value = request.headers.get(name)
    if value is not None and not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise InvalidParameterError(f"The {name} header is not valid UTF-8.") from None
    return value


async def _json_body(request: web.Request, seconds: float) -> Any:
    """The request's JSON body: read within ``seconds``, its Content-Encoding undone
    (the server leaves it to us: see listener.SERVER_OPTIONS), decoded."""
    codings = content_codings(_header(request, "Content-Encoding"))  # 415 before the body is read
    try:
        async with asyncio.timeout(seconds):
            data = await request.read()
    except TimeoutError:
        raise RequestBodyTimeoutError(f"The request body did not arrive within {seconds:g} seconds.") from None
    if codings:  # at most MAX_BODY_BYTES out, but a large body may hold many gzip members
        inline = len(data) <= INLINE_DECODE_BYTES
        data = decode_content(data, codings) if inline else await asyncio.to_thread(decode_content, data, codings)
    if len(data) > INLINE_DECODE_BYTES:
        return await asyncio.to_thread(decode_body, data)
    return decode_body(data)


# --- middlewares ----------------------------------------------------------------------
@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error a handler raises leaves as an OpenAI error body."""
    try:
        return await handler(request)
    except KVServeError as e:
        error = to_http(e)
        if error.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.path, error.status, e)
        response = _json_response(error.body, status=error.status, headers=error.headers)
        if isinstance(e, RequestBodyTimeoutError):
            return await _answer_and_hang_up(request, response)
        return response
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = f"Invalid URL ({request.method} {request.path})" if e.status in (404, 405) else e.reason
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return _json_response(error_body(message, kind), status=e.status)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        body = error_body("internal server error", "server_error", None, "internal_error")
        return _json_response(body, status=500)


async def _answer_and_hang_up(request: web.Request, response: web.Response) -> web.Response:
    """Send ``response`` and end the connection's sending side: a client still sending
    its body sees the answer and EOF now, and what it sends is read and dropped until
    it stops (a lingering close; closing outright could reset the answer away)."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.transport is not None and request.transport.can_write_eof():
        request.transport.write_eof()
    return response


def _json_response(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    body_bytes = msgspec.json.encode(body)
    return web.Response(body=body_bytes, status=status, content_type="application/json", headers=headers)
