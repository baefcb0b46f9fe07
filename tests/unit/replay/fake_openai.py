"""An in-process stand-in for an OpenAI-compatible server: /v1/completions
streams a scripted answer with known delays, or answers with a scripted error.
It keeps every request body and the time each one arrived."""

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Script:
    ttft_s: float = 0.0  # delay before the first token
    itl_s: tuple[float, ...] = ()  # delay before each later token
    status: int = 200
    retry_after: str | None = None
    error_mid_stream: bool = False  # send an error event after the first token
    cached_tokens: int = 0
    predicted_ttft_ms: str | None = None  # kvserve's x-kvserve-predicted-ttft-ms header
    hold: asyncio.Event | None = None  # wait for this before answering at all


@dataclass
class FakeServer:
    scripts: dict[int, Script]  # by the first prompt token id (tests make it the request index)
    default: Script | None = None  # for any other request
    bodies: list[dict] = field(default_factory=list)
    arrivals: dict[int, float] = field(default_factory=dict)
    arrived: dict[int, asyncio.Event] = field(default_factory=dict)

    def event(self, key: int) -> asyncio.Event:
        return self.arrived.setdefault(key, asyncio.Event())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        key = body["prompt"][0]
        self.bodies.append(body)
        self.arrivals[key] = time.perf_counter()
        self.event(key).set()
        script = self.scripts.get(key, self.default)
        if script.hold is not None:
            await script.hold.wait()
        if script.status != 200:
            headers = {"Retry-After": script.retry_after} if script.retry_after else None
            error = {"error": {"message": f"scripted {script.status}", "type": "x", "param": None, "code": None}}
            return web.json_response(error, status=script.status, headers=headers)
        headers = {"Content-Type": "text/event-stream"}
        if script.predicted_ttft_ms is not None:
            headers["x-kvserve-predicted-ttft-ms"] = script.predicted_ttft_ms
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        delays = (script.ttft_s, *script.itl_s)
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)  # the scripted latency being measured
            await _event(response, {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})
            if script.error_mid_stream:
                await _event(response, {"error": {"message": "scripted failure", "type": "server_error"}})
                break
        else:
            await _event(response, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            usage = {
                "prompt_tokens": len(body["prompt"]),
                "completion_tokens": len(delays),
                "total_tokens": len(body["prompt"]) + len(delays),
                "prompt_tokens_details": {"cached_tokens": script.cached_tokens},
            }
            await _event(response, {"choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _event(response: web.StreamResponse, body: dict) -> None:
    await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")


async def start(server: FakeServer) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@contextmanager
def serving_in_thread(server: FakeServer) -> Iterator[str]:
    """Run the fake on its own event loop in a thread, for code that runs its own loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, url = asyncio.run_coroutine_threadsafe(start(server), loop).result(timeout=10)
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
