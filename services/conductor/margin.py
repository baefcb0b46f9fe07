"""What the conductor learns from its own prediction errors: each instance's
speed, and safety margins.

Each prefill an instance reports done gives its measured/predicted service time:
the median of the recent ones is the instance's speed, by which every prefill
prediction for it is scaled (a worker slower than its calibration, or sharing
its cores with another, is predicted as it runs, and its queue with it).

Every settled request gives an observed/predicted ratio: its TTFT, and, once it
ends, its mean TBT against the steps the model gives the batch it ran in (whose
median is the decode instance's speed, by which the conductor forecasts when
requests leave a batch). A margin is a high quantile of the recent ratios: admission
multiplies a prediction by it before comparing with the SLO, so a cost model that
is optimistic (a worker slower than its calibration, contention between
co-located workers, queueing the model does not see) costs refusals instead of
broken promises, and one that is pessimistic gives the capacity back. Per
instance once it has enough samples, else over the whole cluster.
"""

from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass

MIN_SAMPLES = 20  # ratios before a window's quantile is trusted over the next wider one
MIN_MARGIN, MAX_MARGIN = 0.5, 20.0
MIN_SPEED_SAMPLES = 5
_TINY = 1e-6  # seconds: predictions below this say nothing about the ratio


@dataclass(frozen=True)
class MarginConfig:
    quantile: float = 0.95  # of observed/predicted: about this share of admitted requests keep their promise
    window: int = 200  # recent ratios per instance (and for the cluster); 0: learn nothing


class RatioWindow:
    """The last ``size`` observed/predicted ratios and their ``quantile``, kept sorted as
    they come and go, so reading it costs O(1) (admission reads several per request)."""

    def __init__(self, size: int, quantile: float, low: float = MIN_MARGIN, high: float = MAX_MARGIN) -> None:
        self.ratios: deque[float] = deque()
        self.size, self.quantile, self.low, self.high = size, quantile, low, high
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self.ratios)

    def observe(self, observed: float, predicted: float) -> None:
        if predicted <= _TINY or observed < 0 or self.size <= 0:
            return
        ratio = observed / predicted
        if len(self.ratios) == self.size:
            del self._sorted[bisect_left(self._sorted, self.ratios.popleft())]
        self.ratios.append(ratio)
        insort(self._sorted, ratio)

    def value(self) -> float:
        """The quantile of the window, within [low, high]; 1 while it is empty."""
        ordered = self._sorted
        if not ordered:
            return 1.0
        q = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
        return min(self.high, max(self.low, q))


class Margins:
    """Prefill speeds, TTFT and TBT margins: per instance, with the cluster's as the fallback."""

    def __init__(self, config: MarginConfig | None = None) -> None:
        self.config = config or MarginConfig()
        self._ttft: dict[str, RatioWindow] = {}
        self._tbt: dict[str, RatioWindow] = {}
        self._speed: dict[str, RatioWindow] = {}
        self._decode_speed: dict[str, RatioWindow] = {}
        self.ttft_all = self._window()
        self.tbt_all = self._window()
        self.speed_all = self._speed_window()
        self.decode_speed_all = self._speed_window()

    def _speed_window(self) -> RatioWindow:
        return RatioWindow(self.config.window, 0.5, 0.1, MAX_MARGIN)

    def _window(self) -> RatioWindow:
        return RatioWindow(self.config.window, self.config.quantile)

    def observe_ttft(self, instance_id: str, observed: float, predicted: float) -> None:
        self._ttft.setdefault(instance_id, self._window()).observe(observed, predicted)
        self.ttft_all.observe(observed, predicted)

    def observe_tbt(self, instance_id: str, observed: float, predicted: float) -> None:
        self._tbt.setdefault(instance_id, self._window()).observe(observed, predicted)
        self.tbt_all.observe(observed, predicted)
        self._decode_speed.setdefault(instance_id, self._speed_window()).observe(observed, predicted)
        self.decode_speed_all.observe(observed, predicted)

    def decode_speed(self, instance_id: str) -> float:
        """Measured/modelled step time, the median over recent requests decoded on ``instance_id``."""
        return _pick(self._decode_speed.get(instance_id), self.decode_speed_all, MIN_SPEED_SAMPLES)

    def observe_prefill(self, instance_id: str, measured: float, predicted: float) -> None:
        self._speed.setdefault(instance_id, self._speed_window()).observe(measured, predicted)
        self.speed_all.observe(measured, predicted)

    def prefill_speed(self, instance_id: str) -> float:
        """Measured/predicted prefill time, the median of recent prefills on ``instance_id``."""
        return _pick(self._speed.get(instance_id), self.speed_all, MIN_SPEED_SAMPLES)

    def ttft(self, instance_id: str) -> float:
        return _pick(self._ttft.get(instance_id), self.ttft_all)

    def tbt(self, instance_id: str) -> float:
        return _pick(self._tbt.get(instance_id), self.tbt_all)

    def forget(self, instance_id: str) -> None:
        self._ttft.pop(instance_id, None)
        self._tbt.pop(instance_id, None)
        self._speed.pop(instance_id, None)
        self._decode_speed.pop(instance_id, None)


def _pick(own: RatioWindow | None, cluster: RatioWindow, enough: int = MIN_SAMPLES) -> float:
    if own is not None and len(own) >= enough:
        return own.value()
    return cluster.value() if len(cluster) >= enough else 1.0
