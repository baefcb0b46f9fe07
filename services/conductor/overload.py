"""Overload: which requests to keep when not all fit.

Goodput counts requests, and a prefill instance computes the shortest work first,
so a prompt admitted now is pushed back by every shorter prompt that arrives while
it waits or runs. Admission predicts that: a prompt's TTFT grows by the share of
the instance the prompts shorter than it are taking (their recent admitted work per
second, ``rho``), ``ttft / (1 - rho)``, as in a shortest-first queue's busy period.
Shorter means fewer tokens, not a lower band: a 500-token prompt is pushed back by
one of 200 tokens as surely as by one of 20, so a band's own shorter prompts count
too (else they take the room admission kept for the band below). The shortest band
is not held back: no band below it needs the room, the prompts that would go ahead
of one cost about what it does, and the promise it is admitted with keeps them from
pushing it past its target (``rho`` = 0 there). ``rho`` is at most
MAX_SHARE: what was admitted in a burst is already queued (and placed), not a rate
that goes on, so no burst turns the prediction into a refusal of every longer prompt.
Under load that refuses long prompts before they take the time many short ones
would have met their SLOs in; at light load ``rho`` is small and changes nothing, and on
an instance that is idle or about to be (what is booked there ends within a chunk) it
is not applied at all (``admission_policy.py``).

A guard bounds the preference: a band whose recent refusal rate exceeds
``max_refusal_ratio`` times the rate over every band (and 10%) is judged on its own
prediction alone until it is back under, so long prompts are not starved at
moderate load. Pure bookkeeping over the caller's clock.
"""

from collections import deque
from dataclasses import dataclass

from libs.common.prefill_order import BAND_NAMES, band_of

WINDOW_S = 30.0  # admitted work per second is averaged over this long
MIN_SPAN_S = 5.0  # ... or since the first admission, but never over less than this (a burst is not a rate)
# the most of an instance shorter prompts are taken to keep taking: a burst of them, or one
# measured over a short span, predicts at most this (TTFT x 4), never a prompt that cannot start
MAX_SHARE = 0.75
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
        self._admitted: deque[tuple[float, int, float]] = deque()  # (when, prompt tokens, prefill seconds)
        self._decisions: deque[tuple[int, bool]] = deque(maxlen=DECISIONS)  # (band, refused)
        # their counts, kept as they come and go: (decisions, refusals), per band and over all
        self._counts = [[0, 0] for _ in BAND_NAMES]
        self._all = [0, 0]
        self._since: float | None = None  # the first admission seen

    def observe(self, now: float, num_prompt_tokens: int, work_s: float, admitted: bool) -> None:
        band = band_of(num_prompt_tokens)
        if len(self._decisions) == DECISIONS:
            self._count(*self._decisions[0], -1)
        self._decisions.append((band, not admitted))
        self._count(band, not admitted, 1)
        if admitted:
            self._admitted.append((now, num_prompt_tokens, work_s))
            if self._since is None:
                self._since = now

    def shorter_share(self, num_prompt_tokens: int, now: float, num_instances: int) -> float:
        """The share of a prefill instance that admitted prompts shorter than this one took
        over the last ``WINDOW_S`` seconds, or since the first admission when that is sooner
        (0 in the shortest band, and when the guard protects its band)."""
        band = band_of(num_prompt_tokens)
        if self.config.max_refusal_ratio <= 0 or band == 0 or self.guarded(band):
            return 0.0
        while self._admitted and self._admitted[0][0] < now - WINDOW_S:
            self._admitted.popleft()
        work = sum(w for _, tokens, w in self._admitted if tokens < num_prompt_tokens)
        # a conductor that started less than a window ago has seen only that much of the load
        span = WINDOW_S if self._since is None else min(WINDOW_S, max(MIN_SPAN_S, now - self._since))
        return min(MAX_SHARE, work / span / max(1, num_instances))

    def _count(self, band: int, refused: bool, sign: int) -> None:
        for counts in (self._counts[band], self._all):
            counts[0] += sign
            counts[1] += sign * refused

    def guarded(self, band: int) -> bool:
        """Whether ``band`` has been refused too often, against every band, to be held back further."""
        decided, refused = self._counts[band]
        if not decided:
            return False
        overall = self._all[1] / self._all[0]
        return refused / decided > max(MIN_GUARD_RATE, self.config.max_refusal_ratio * overall)

    def refusal_rates(self) -> dict[str, float]:
        """Recent refusal rate per band (the console and tests read it)."""
        return {name: refused / decided for (decided, refused), name in zip(self._counts, BAND_NAMES) if decided}
