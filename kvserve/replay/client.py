"""The open-loop replayer: sends every planned request at its scheduled time —
never waiting for earlier ones — to an OpenAI-compatible ``/v1/completions``
endpoint, streams the answer and records what the client saw.

Token ids go out as the ``prompt`` array with ``ignore_eos``, greedy sampling
and ``stream_options.include_usage``, so any server that takes token arrays
(kvserve's gateway, vLLM, llama.cpp's server) gets exactly the same work. An
HTTP 429 is a rejection, anything else that does not end in a full stream is an
error. Nothing here computes statistics.
"""

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from kvserve.replay.prompts import PromptSynthesizer
from kvserve.replay.records import RequestRecord, Run
from kvserve.replay.trace import TraceRequest, arrival_offsets_ms


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # scheme://host:port, with or without a trailing /v1
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0  # per request, end to end

    @property
    def completions_url(self) -> str:
        base = self.base_url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + "/completions"


@dataclass
class PlannedRequest:
    prompt: list[int]
    record: RequestRecord  # filled in as the request runs


class StreamError(Exception):
    """The server ended or broke a stream it had started."""


def plan(
    requests: Sequence[TraceRequest],
    synth: PromptSynthesizer,
    time_scale: float,
    spread: bool = False,
    warmed: Sequence[Sequence[int]] = (),
) -> list[PlannedRequest]:
    """Prompts and send times for a trace window, computed before the clock starts.
    Send times are the trace's timestamps, relative to the window's first, times
    ``time_scale`` (0.5 replays twice as fast); ``spread``: see ``arrival_offsets_ms``;
    ``warmed``: hash-id prefixes sent before the run (``history.warm``), which count
    as sent for ``cached_blocks_expected``."""
    if time_scale < 0:
        raise ValueError("time_scale must not be negative")
    offsets = arrival_offsets_ms(list(requests), spread)
    seen: set[int] = {hash_id for prefix in warmed for hash_id in prefix}
    planned = []
    for request in sorted(requests, key=lambda r: (r.timestamp_ms, r.index)):
        blocks = request.hash_ids[: synth.num_shared_blocks(request)]
        reusable = next((i for i, h in enumerate(blocks) if h not in seen), len(blocks))
        seen.update(blocks)
        record = RequestRecord(
            index=request.index,
            scheduled_s=offsets[request.index] / 1000.0 * time_scale,
            input_tokens=synth.input_length(request),
            max_tokens=synth.output_length(request),
            cached_blocks_expected=reusable,
        )
        planned.append(PlannedRequest(synth.prompt(request), record))
    return planned


async def replay(
    endpoint: Endpoint,
    planned: Sequence[PlannedRequest],
    *,
    label: str = "",
    time_scale: float = 1.0,
    settings: dict[str, Any] | None = None,
    progress: bool = True,
) -> Run:
    """Send ``planned`` open-loop and return the run once every request has ended."""
    bar = tqdm(total=len(planned), desc=label or "replay", unit="req", disable=not progress, dynamic_ncols=True)
    counts = {"ok": 0, "rejected": 0, "error": 0}
    connector = aiohttp.TCPConnector(limit=0)  # open loop: no client-side cap on concurrency
    timeout = aiohttp.ClientTimeout(total=endpoint.timeout_s)
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:

        async def one(item: PlannedRequest, t0: float) -> None:
            await send(session, endpoint, item, t0)
            counts[item.record.status] += 1
            bar.set_postfix(counts, refresh=False)
            bar.update(1)

        tasks = []
        t0 = time.perf_counter()
        for item in sorted(planned, key=lambda p: p.record.scheduled_s):
            delay = t0 + item.record.scheduled_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the trace's clock, not a synchronisation
            tasks.append(asyncio.create_task(one(item, t0)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    records = sorted((p.record for p in planned), key=lambda r: r.index)
    return Run(label, endpoint.base_url, time_scale, duration, records, dict(settings or {}))


async def send(session: aiohttp.ClientSession, endpoint: Endpoint, item: PlannedRequest, t0: float) -> None:
    """Send one request and fill in its record; never raises for what the server does."""
    record = item.record
    body = {
        "model": endpoint.model,
        "prompt": item.prompt,
        "max_tokens": record.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    record.start_s = start - t0
    try:
        async with session.post(endpoint.completions_url, json=body) as response:
            record.http_status = response.status
            if response.status != 200:
                record.ended_s = time.perf_counter() - t0  # a refusal counts from its status line, not its body
                raw = await response.read()
                record.error = f"HTTP {response.status}: {_error_message(raw)}"
                record.error_code = _error_code(raw)
                if response.status == 429:
                    record.status = "rejected"
                    record.retry_after_s = _seconds(response.headers.get("Retry-After"))
                return
            if (predicted := _seconds(response.headers.get("x-kvserve-predicted-ttft-ms"))) is not None:
                record.predicted_ttft_s = predicted / 1e3
            await _read_stream(response, record, start)
        record.status = "ok"
    except StreamError as e:
        record.error = str(e)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        if record.ended_s is None:
            record.ended_s = time.perf_counter() - t0


async def _read_stream(response: aiohttp.ClientResponse, record: RequestRecord, start: float) -> None:
    """Parse the SSE stream: a chunk whose first choice carries text is a token event."""
    last: float | None = None
    events = 0
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        now = time.perf_counter()
        chunk = json.loads(data)
        if "error" in chunk:
            raise StreamError(f"error event mid-stream: {_message(chunk)}")
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            if last is None:
                record.ttft_s = now - start
            else:
                record.itl_s.append(now - last)
            last = now
            events += 1
        if usage := chunk.get("usage"):
            record.output_tokens = int(usage.get("completion_tokens") or 0)
            record.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens")
    record.e2e_s = time.perf_counter() - start
    if last is None:
        raise StreamError("the stream ended without a token")
    if record.output_tokens == 0:  # a server that sends no usage: count the chunks
        record.output_tokens = events


def _error_message(body: bytes) -> str:
    try:
        return _message(json.loads(body))
    except ValueError:
        return body[:200].decode(errors="replace")


def _error_code(body: bytes) -> str | None:
    """The ``error.code`` of an OpenAI error body, when it has one."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error if error is not None else body)[:200]


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
