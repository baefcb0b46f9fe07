"""What the conductor learns from its own prediction errors: each instance's
speed, and safety margins.

Each prefill an instance reports done gives its measured/predicted service time:
the median of the recent ones is the instance's speed, by which every prefill
prediction for it is scaled (a worker slower than its calibration, or sharing
its cores with another, is predicted as it runs, and its queue with it).

Every settled request gives its TTFT's observed - predicted (kept per
prompt-size band), and, once it ends, its mean TBT's observed/predicted ratio against the steps the model gives the batch it ran in (whose
median is the decode instance's speed, by which the conductor forecasts when
requests leave a batch). A margin is a high quantile of the recent ratios: admission
multiplies a prediction by it before comparing with the SLO, so a cost model that
is optimistic (a worker slower than its calibration, contention between
co-located workers, queueing the model does not see) costs refusals instead of
broken promises, and one that is pessimistic gives the capacity back. Per
instance (TTFT: per band) once it has enough samples, else over the whole
cluster. Margins are bounded and forget ratios older than a few minutes, and the
scheduler feeds them no sample taken across a fault, a restart or a migration.
"""

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from libs.common.prefill_order import BAND_NAMES, band_of
from libs.protocol.ids import InstanceId

MIN_SAMPLES = 20  # ratios before a window's quantile is trusted over the next wider one
# A margin only covers the spread of the predictions around what the instance runs at (its
# speed is learned apart), so it is bounded: no burst, kill or restart can turn it into a
# refusal of everyone.
TTFT_SLACK_S = (0.0, 0.5)  # seconds added to a TTFT prediction: what happens outside the prefill steps
TBT_MARGIN = (0.8, 2.0)
MIN_SPEED, MAX_SPEED = 0.1, 20.0
MIN_SPEED_SAMPLES = 5
_TINY = 1e-6  # seconds: predictions below this say nothing about the ratio


@dataclass(frozen=True)
class MarginConfig:
    quantile: float = 0.95  # of observed/predicted: about this share of admitted requests keep their promise
    window: int = 100  # recent ratios per window; 0: learn nothing
    max_age_s: float = 300.0  # a ratio older than this is forgotten: the margin decays back to what runs now


class RatioWindow:
    """The last ``size`` observed/predicted ratios (none older than ``max_age_s``) and
    their ``quantile``, kept sorted as they come and go, so reading it is cheap
    (admission reads several per request)."""

    def __init__(self, size: int, quantile: float, low: float, high: float, max_age_s: float = float("inf"),
                 clock: Callable[[], float] | None = None, additive: bool = False) -> None:  # fmt: skip
        self.ratios: deque[tuple[float, float]] = deque()  # (when, ratio)
        self.size, self.quantile, self.low, self.high = size, quantile, low, high
        self.additive = additive  # observed - predicted instead of observed / predicted
        self.max_age_s, self.clock = max_age_s, clock
        self._sorted: list[float] = []
        # read far more often than written: the value, until a ratio comes or goes, and
        # the time before which no ratio is old enough to be forgotten
        self._value: float | None = None
        self._fresh_until = float("inf")

    def __len__(self) -> int:
        self._expire()
        return len(self.ratios)

    def observe(self, observed: float, predicted: float) -> None:
        if (predicted <= _TINY and not self.additive) or observed < 0 or self.size <= 0:
            return
        ratio = observed - predicted if self.additive else observed / predicted
        if len(self.ratios) == self.size:
            self._drop_oldest()
        self.ratios.append((self.clock() if self.clock else 0.0, ratio))
        insort(self._sorted, ratio)
        self._value = None
        self._set_fresh_until()

    def value(self) -> float:
        """The quantile of the window, within [low, high]; while it is empty, 1 (0 for
        differences)."""
        self._expire()
        if self._value is not None:
            return self._value
        ordered = self._sorted
        if not ordered:
            return 0.0 if self.additive else 1.0
        q = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
        self._value = min(self.high, max(self.low, q))
        return self._value

    def changes_at(self) -> float | None:
        """When its oldest ratio is forgotten (its value may change then with no new
        sample); None: not by the clock."""
        if self.clock is None or not self.ratios:
            return None
        return self.ratios[0][0] + self.max_age_s

    def _drop_oldest(self) -> None:
        del self._sorted[bisect_left(self._sorted, self.ratios.popleft()[1])]
        self._value = None

    def _set_fresh_until(self) -> None:
        self._fresh_until = self.ratios[0][0] + self.max_age_s if self.clock is not None and self.ratios else float("inf")

    def _expire(self) -> None:
        if self._fresh_until == float("inf"):
            return
        now = self.clock()
        if now <= self._fresh_until:  # the oldest ratio is not yet older than max_age_s
            return
        oldest = now - self.max_age_s
        while self.ratios and self.ratios[0][0] < oldest:
            self._drop_oldest()
        self._set_fresh_until()


class Margins:
    """Prefill speeds (per instance), TTFT slack (per prompt-size band: a long prompt's
    prediction errs otherwise than a short one's) and TBT margins (per instance), each
    with the cluster's as the fallback.

    The TTFT slack is additive: a high quantile of observed - predicted, seconds. Most
    of a TTFT the cost model does not see is a fixed cost per request (the round trips
    to the conductor, the decode worker's lease, the first token's way back), which a
    ratio would turn into a wide margin for short prompts; how fast the worker
    computes is its speed, learned apart."""

    def __init__(self, config: MarginConfig | None = None, clock: Callable[[], float] | None = None) -> None:
        self.config = config or MarginConfig()
        self.clock = clock
        self._ttft: dict[int, RatioWindow] = {}
        self._tbt: dict[str, RatioWindow] = {}
        self._speed: dict[str, RatioWindow] = {}
        self._decode_speed: dict[str, RatioWindow] = {}
        self.ttft_all = self._slack_window()
        self.tbt_all = self._window(*TBT_MARGIN)
        self.speed_all = self._speed_window()
        self.decode_speed_all = self._speed_window()
        self.on_speed: list[Callable[[str], None]] = []  # told of each instance whose speed took a sample

    def _speed_window(self) -> RatioWindow:
        return RatioWindow(self.config.window, 0.5, MIN_SPEED, MAX_SPEED, self.config.max_age_s, self.clock)

    def _slack_window(self) -> RatioWindow:
        return RatioWindow(self.config.window, self.config.quantile, *TTFT_SLACK_S, self.config.max_age_s, self.clock,
                           additive=True)  # fmt: skip

    def _window(self, low: float, high: float) -> RatioWindow:
        return RatioWindow(self.config.window, self.config.quantile, low, high, self.config.max_age_s, self.clock)

    def observe_ttft(self, num_prompt_tokens: int, observed: float, predicted: float) -> None:
        band = band_of(num_prompt_tokens)
        self._ttft.setdefault(band, self._slack_window()).observe(observed, predicted)
        self.ttft_all.observe(observed, predicted)

    def observe_tbt(self, instance_id: InstanceId, observed: float, predicted: float) -> None:
        self._tbt.setdefault(instance_id, self._window(*TBT_MARGIN)).observe(observed, predicted)
        self.tbt_all.observe(observed, predicted)
        self._decode_speed.setdefault(instance_id, self._speed_window()).observe(observed, predicted)
        self.decode_speed_all.observe(observed, predicted)
        for listener in self.on_speed:
            listener(instance_id)

    def decode_speed(self, instance_id: InstanceId) -> float:
        """Measured/modelled step time, the median over recent requests decoded on ``instance_id``."""
        return _pick(self._decode_speed.get(instance_id), self.decode_speed_all, MIN_SPEED_SAMPLES)

    def decode_speeds(self) -> Callable[[InstanceId], float]:
        """`decode_speed` for many instances at one moment: the cluster's, which most of
        them take, read once."""
        cluster = _pick(None, self.decode_speed_all, MIN_SPEED_SAMPLES)
        own = self._decode_speed

        def speed(instance_id: InstanceId) -> float:
            window = own.get(instance_id)
            if window is None or len(window.ratios) < MIN_SPEED_SAMPLES:  # fewer still once the old are forgotten
                return cluster
            return window.value() if len(window) >= MIN_SPEED_SAMPLES else cluster

        return speed

    def observe_prefill(self, instance_id: InstanceId, measured: float, predicted: float) -> None:
        self._speed.setdefault(instance_id, self._speed_window()).observe(measured, predicted)
        self.speed_all.observe(measured, predicted)
        for listener in self.on_speed:
            listener(instance_id)

    def prefill_speed(self, instance_id: InstanceId) -> float:
        """Measured/predicted prefill time, the median of recent prefills on ``instance_id``."""
        return _pick(self._speed.get(instance_id), self.speed_all, MIN_SPEED_SAMPLES)

    def own_prefill_speed(self, instance_id: InstanceId) -> tuple[float, float | None] | None:
        """``instance_id``'s prefill speed where it is its own (enough recent samples), and
        when it may next change with no new sample (`RatioWindow.changes_at`); None: it
        has the cluster's."""
        return _own(self._speed.get(instance_id))

    def own_decode_speed(self, instance_id: InstanceId) -> tuple[float, float | None] | None:
        """The same for ``instance_id``'s decode speed."""
        return _own(self._decode_speed.get(instance_id))

    def ttft(self, num_prompt_tokens: int) -> float:
        """The TTFT slack (seconds) for a prompt of this size: its band's, else every band's."""
        return _pick(self._ttft.get(band_of(num_prompt_tokens)), self.ttft_all, default=0.0)

    def tbt(self, instance_id: InstanceId) -> float:
        return _pick(self._tbt.get(instance_id), self.tbt_all)

    def slack_by_band(self) -> dict[str, float]:
        """The TTFT slack each prompt-size band gets now (seconds)."""
        return {name: _pick(self._ttft.get(band), self.ttft_all, default=0.0) for band, name in enumerate(BAND_NAMES)}

    def tbt_by_instance(self) -> dict[str, float]:
        return {instance_id: self.tbt(instance_id) for instance_id in self._tbt}

    def forget(self, instance_id: InstanceId) -> None:
        self._tbt.pop(instance_id, None)
        self._speed.pop(instance_id, None)
        self._decode_speed.pop(instance_id, None)


def _own(window: RatioWindow | None) -> tuple[float, float | None] | None:
    if window is None or len(window) < MIN_SPEED_SAMPLES:
        return None
    return window.value(), window.changes_at()


def _pick(own: RatioWindow | None, cluster: RatioWindow, enough: int = MIN_SAMPLES, default: float = 1.0) -> float:
    if own is not None and len(own) >= enough:
        return own.value()
    return cluster.value() if len(cluster) >= enough else default
