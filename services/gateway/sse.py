"""Server-Sent Events framing exactly as OpenAI streams: one ``data: <json>\\n\\n``
event per chunk, then ``data: [DONE]\\n\\n``."""

from typing import Any

import msgspec
from aiohttp import web

DONE = b"data: [DONE]\n\n"


def event(body: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def open_stream(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    """Send the status and headers of an event stream; the events follow with ``write``."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not hold events back
            **headers,
        }
    )
    await response.prepare(request)
    return response
