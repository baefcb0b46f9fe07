"""A request's latency targets (service-level objectives), in seconds: one type for the
gateway, the conductor, the simulator and the replay client, and the one place the
defaults are written; `SLOOverride`, a request's own targets where it sets them.

``tbt_s`` is the time between tokens. The conductor admits against a batch's predicted
step time; a finished request is judged on its mean time per output token (TPOT), as
vLLM's goodput does.
"""

from dataclasses import dataclass

DEFAULT_TTFT_S = 2.0
DEFAULT_TBT_S = 0.150


@dataclass(frozen=True)
class SLO:
    ttft_s: float = DEFAULT_TTFT_S
    tbt_s: float = DEFAULT_TBT_S

    @classmethod
    def from_ms(cls, ttft_ms: float, tbt_ms: float) -> "SLO":
        return cls(ttft_ms / 1e3, tbt_ms / 1e3)

    def overridden(self, ttft_s: float | None, tbt_s: float | None) -> "SLO":
        """These targets with a request's own where it gave them."""
        return SLO(ttft_s or self.ttft_s, tbt_s or self.tbt_s)

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Whether a request with this time to first token and mean time per output
        token met both targets (None: not measured, so not met)."""
        return ttft_s is not None and tpot_s is not None and ttft_s <= self.ttft_s and tpot_s <= self.tbt_s


@dataclass(frozen=True)
class SLOOverride:
    """Per-request targets (from the x-kvserve-slo-* headers); None: the conductor's default.
    ``best_effort`` (x-kvserve-slo: best-effort): no target, served in time SLO work does not need."""

    ttft_s: float | None = None
    tbt_s: float | None = None
    best_effort: bool = False
