"""Concurrent streaming chat clients that record how each stream ended.

For fault tests and `bench/chaos.py`: every client streams one chat completion
from an OpenAI-compatible server and records whether the stream closed with
``data: [DONE]``, whether it carried an error event, its finish reason, its text,
and the longest silence between two bytes. Nothing here judges the outcome.
"""

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp


@dataclass
class StreamOutcome:
    index: int
    status: int = 0  # HTTP status (0: no response at all)
    done: bool = False  # the stream ended with data: [DONE]
    error: str | None = None  # an SSE error event's message, an HTTP error body, or what broke the connection
    finish_reason: str | None = None
    text: str = ""
    num_chunks: int = 0
    served_by: dict | None = None  # the final chunk's kvserve field, where the server sends one
    started_at: float = 0.0  # time.monotonic() when the request went out
    first_byte_at: float | None = None
    ended_at: float | None = None
    max_silence_s: float = 0.0  # the longest wait for a byte, from sending the request to the end

    @property
    def completed(self) -> bool:
        """Ended normally: [DONE], no error, a finish reason other than "error"."""
        return self.done and self.error is None and self.finish_reason not in (None, "error")

    @property
    def errored_cleanly(self) -> bool:
        """Ended with an error event (or an HTTP error status) and then [DONE] or a closed body."""
        return self.error is not None and (self.done or self.status >= 400)


@dataclass(frozen=True)
class ChatLoad:
    base_url: str  # http://host:port (with or without /v1)
    model: str
    prompts: Sequence[str]
    max_tokens: int = 64
    api_key: str | None = None
    timeout_s: float = 180.0  # per stream, end to end: a hang shows as an error here, never as a stuck test
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)  # sent with every request (e.g. x-kvserve-slo)

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + "/chat/completions"


async def run_streams(
    load: ChatLoad, started: asyncio.Event | None = None, started_after: int | None = None
) -> list[StreamOutcome]:
    """Stream every prompt at once. ``started`` is set once ``started_after`` streams (all
    by default) have their first token (or ended), so a caller can inject a fault mid-stream."""
    outcomes = [StreamOutcome(i) for i in range(len(load.prompts))]
    first_tokens = asyncio.Semaphore(0)
    headers = dict(load.headers) | ({"Authorization": f"Bearer {load.api_key}"} if load.api_key else {})
    connector = aiohttp.TCPConnector(limit=0)
    needed = len(outcomes) if started_after is None else min(started_after, len(outcomes))
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def watch_first_tokens() -> None:
            for _ in range(needed):
                await first_tokens.acquire()
            if started is not None:
                started.set()

        watcher = asyncio.create_task(watch_first_tokens())
        await asyncio.gather(*(_one(session, load, p, o, first_tokens) for p, o in zip(load.prompts, outcomes)))
        watcher.cancel()
    return outcomes


async def streams_with_a_fault(load: ChatLoad, fault: Callable[[], object], after: int,
                               timeout_s: float = 120.0) -> list[StreamOutcome]:  # fmt: skip
    """Stream every prompt at once; once ``after`` streams have their first token, call
    ``fault()`` (in a thread: a kill may wait for its process), then wait for them all."""
    started = asyncio.Event()
    streams = asyncio.create_task(run_streams(load, started, started_after=after))
    await asyncio.wait_for(started.wait(), timeout=timeout_s)
    await asyncio.to_thread(fault)
    return await streams


async def _one(
    session: aiohttp.ClientSession, load: ChatLoad, prompt: str, out: StreamOutcome, first_tokens: asyncio.Semaphore
) -> None:
    body = {
        "model": load.model, "messages": [{"role": "user", "content": prompt}], "stream": True,
        "max_tokens": load.max_tokens, "temperature": 0, **load.extra_body,
    }  # fmt: skip
    out.started_at = last = time.monotonic()
    signalled = False

    def byte_arrived() -> None:
        nonlocal last, signalled
        now = time.monotonic()
        out.max_silence_s = max(out.max_silence_s, now - last)
        last = now
        if out.first_byte_at is None:
            out.first_byte_at = now
        if out.text and not signalled:
            signalled = True
            first_tokens.release()

    try:
        async with asyncio.timeout(load.timeout_s):
            async with session.post(load.url, json=body) as response:
                out.status = response.status
                byte_arrived()
                if response.status != 200:
                    out.error = (await response.text())[:500]
                    return
                async for raw in response.content:
                    _read_line(raw.decode(errors="replace").strip(), out)
                    byte_arrived()
    except TimeoutError:
        out.error = out.error or f"no end within {load.timeout_s:g}s"
    except (aiohttp.ClientError, ConnectionError) as e:
        out.error = out.error or f"connection broke: {type(e).__name__}: {e}"
    finally:
        out.ended_at = time.monotonic()
        out.max_silence_s = max(out.max_silence_s, out.ended_at - last)
        if not signalled:
            first_tokens.release()


def _read_line(line: str, out: StreamOutcome) -> None:
    if not line.startswith("data:"):
        return
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        out.done = True
        return
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        out.error = out.error or f"undecodable event: {data[:200]}"
        return
    if "error" in event:
        error = event["error"]
        out.error = (error.get("message") if isinstance(error, dict) else str(error)) or "error"
        return
    out.num_chunks += 1
    if "kvserve" in event:
        out.served_by = event["kvserve"]
    for choice in event.get("choices") or []:
        out.text += (choice.get("delta") or {}).get("content") or ""
        if choice.get("finish_reason"):
            out.finish_reason = choice["finish_reason"]


@dataclass(frozen=True)
class Tally:
    sent: int
    completed: int  # [DONE] and a normal finish
    errored: int  # an error event (then [DONE]) or an HTTP error
    broken: int  # neither: cut without [DONE] or an error, or never answered
    migrated: int  # completed streams served by more than one decode or prefill instance
    max_silence_s: float

    def line(self) -> str:
        return (f"{self.sent} sent: {self.completed} completed ({self.migrated} migrated), {self.errored} errored, "
                f"{self.broken} broken; longest silence {self.max_silence_s:.1f}s")  # fmt: skip


def tally(outcomes: Sequence[StreamOutcome]) -> Tally:
    completed = [o for o in outcomes if o.completed]
    errored = [o for o in outcomes if not o.completed and o.errored_cleanly]
    migrated = [o for o in completed if o.served_by and o.served_by.get("migrations")]
    return Tally(
        sent=len(outcomes),
        completed=len(completed),
        errored=len(errored),
        broken=len(outcomes) - len(completed) - len(errored),
        migrated=len(migrated),
        max_silence_s=max((o.max_silence_s for o in outcomes), default=0.0),
    )
