"""What one replayed request measured, and one run of a trace (its records plus
how it was run), with their JSON form. Plain data: no I/O beyond JSON files."""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["ok", "rejected", "error"]


@dataclass
class RequestRecord:
    """Client-side measurements of one request; times in seconds. ``start_s`` and
    ``ended_s`` are when it was sent and when its answer ended, counted from the
    start of the run; ``ttft_s`` and ``e2e_s`` from ``start_s``. ``itl_s`` holds
    every gap between two chunks that carried text. Files written before
    ``ended_s`` existed load with it None."""

    index: int  # the trace request's index
    scheduled_s: float  # when the trace (times the time scale) says it arrives
    input_tokens: int  # prompt tokens sent
    max_tokens: int
    cached_blocks_expected: int = 0  # hash-id blocks an earlier request of the run (or its warming) sent
    status: Status = "error"
    http_status: int | None = None
    error: str | None = None
    error_code: str | None = None  # the error body's code (a 429: rate_limit_exceeded, slo_unattainable, ...)
    start_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0  # usage.completion_tokens, else the number of text chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens as the server counted them
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    retry_after_s: float | None = None  # a 429's Retry-After
    ended_s: float | None = None  # a 429's arrival, the stream's end or the failure, from the start of the run
    predicted_ttft_s: float | None = None  # the TTFT kvserve's conductor predicted (x-kvserve-predicted-ttft-ms)

    @property
    def first_token_at_s(self) -> float | None:
        """When the first token arrived, from the start of the run; None without one."""
        return None if self.ttft_s is None else self.start_s + self.ttft_s

    @property
    def end_at_s(self) -> float | None:
        """``ended_s``, or for a request of an older file: a completed one's send plus e2e,
        a refused one's send (a 429 comes back within milliseconds)."""
        if self.ended_s is not None:
            return self.ended_s
        if self.status == "rejected":
            return self.start_s
        return None if self.e2e_s is None else self.start_s + self.e2e_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as vLLM's benchmark defines it:
        ``(e2e - ttft) / (output_tokens - 1)``; 0 for a one-token answer."""
        if self.status != "ok" or self.ttft_s is None or self.e2e_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Run:
    """One replay of a trace window against one endpoint at one time scale."""

    label: str
    base_url: str
    time_scale: float
    duration_s: float  # from the first scheduled send to the last response's end
    records: list[RequestRecord]
    settings: dict[str, Any] = field(default_factory=dict)  # how it was run: trace, block tokens, seed, ...

    @property
    def offered_rps(self) -> float | None:
        """The arrival rate the run offered: (requests - 1) over the span of arrivals."""
        times = [r.scheduled_s for r in self.records]
        span = max(times) - min(times) if times else 0.0
        return (len(times) - 1) / span if span > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "base_url": self.base_url,
            "time_scale": self.time_scale,
            "duration_s": self.duration_s,
            "settings": self.settings,
            "requests": [asdict(r) for r in self.records],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Run":
        return cls(
            label=data["label"],
            base_url=data["base_url"],
            time_scale=data["time_scale"],
            duration_s=data["duration_s"],
            settings=data.get("settings", {}),
            records=[RequestRecord(**r) for r in data["requests"]],
        )

    def save(self, path: Path, summary: dict[str, Any] | None = None) -> None:
        body = self.to_json() if summary is None else {"summary": summary} | self.to_json()
        path.write_text(json.dumps(body, indent=1))

    @classmethod
    def load(cls, path: Path) -> "Run":
        return cls.from_json(json.loads(path.read_text()))
