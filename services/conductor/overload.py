"""Overload: which requests to keep when not all fit.

Goodput counts requests, and a prefill instance computes the shortest work first,
so a long prompt admitted now is pushed back by every shorter prompt that arrives
while it waits or runs. Admission predicts that: a prompt's TTFT grows by the
share of the instance the shorter prompts are taking (their recent admitted work
per second, ``rho``), ``ttft / (1 - rho)``, as in a priority queue's busy period.
Under load that refuses long prompts before they take the time many short ones
would have met their SLOs in; at light load ``rho`` is small and changes nothing.

A guard bounds the preference: a band whose recent refusal rate exceeds
``max_refusal_ratio`` times the rate over every band (and 10%) is judged on its own
prediction alone until it is back under, so long prompts are not starved at
moderate load. Pure bookkeeping over the caller's clock.
"""

from collections import deque
from dataclasses import dataclass

from libs.common.prefill_order import BAND_NAMES, band_of

WINDOW_S = 30.0  # admitted work per second is averaged over this long
MIN_SPAN_S = 1.0  # ... or since the first admission, but never over less than this
DECISIONS = 200  # recent decisions the refusal rates are taken over
MIN_GUARD_RATE = 0.10  # a band refused less often than this is never protected by the guard


@dataclass(frozen=True)
class OverloadConfig:
    # a band may be refused at most this many times as often as all requests are before the
    # preference for shorter prompts stops applying to it; 0: no preference at all
    max_refusal_ratio: float = 3.0


class Overload:
    def __init__(self, config: OverloadConfig | None = None) -> None:
        self.config = config or OverloadConfig()
        self._admitted: deque[tuple[float, int, float]] = deque()  # (when, band, prefill seconds)
        self._decisions: deque[tuple[int, bool]] = deque(maxlen=DECISIONS)  # (band, refused)
        self._since: float | None = None  # the first admission seen

    def observe(self, now: float, num_prompt_tokens: int, work_s: float, admitted: bool) -> None:
        band = band_of(num_prompt_tokens)
        self._decisions.append((band, not admitted))
        if admitted:
            self._admitted.append((now, band, work_s))
            if self._since is None:
                self._since = now

    def shorter_share(self, num_prompt_tokens: int, now: float, num_instances: int) -> float:
        """The share of a prefill instance that admitted prompts of the bands below this
        prompt's took over the last ``WINDOW_S`` seconds, or since the first admission when
        that is sooner (0 when the guard protects its band)."""
        band = band_of(num_prompt_tokens)
        if band == 0 or self.config.max_refusal_ratio <= 0 or self.guarded(band):
            return 0.0
        while self._admitted and self._admitted[0][0] < now - WINDOW_S:
            self._admitted.popleft()
        work = sum(w for _, b, w in self._admitted if b < band)
        # a conductor that started less than a window ago has seen only that much of the load
        span = WINDOW_S if self._since is None else min(WINDOW_S, max(MIN_SPAN_S, now - self._since))
        return work / span / max(1, num_instances)

    def guarded(self, band: int) -> bool:
        """Whether ``band`` has been refused too often, against every band, to be held back further."""
        decisions = self._decisions
        if not decisions:
            return False
        mine = [refused for b, refused in decisions if b == band]
        if not mine:
            return False
        rate = sum(mine) / len(mine)
        overall = sum(refused for _, refused in decisions) / len(decisions)
        return rate > max(MIN_GUARD_RATE, self.config.max_refusal_ratio * overall)

    def refusal_rates(self) -> dict[str, float]:
        """Recent refusal rate per band (the console and tests read it)."""
        out = {}
        for band, name in enumerate(BAND_NAMES):
            mine = [refused for b, refused in self._decisions if b == band]
            if mine:
                out[name] = sum(mine) / len(mine)
        return out
