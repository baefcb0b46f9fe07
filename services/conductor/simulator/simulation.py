"""The discrete-event loop: trace arrivals go through the live conductor's
Admitter (same policies, KV index, cost model and load bookkeeping), and the
simulated instances (`instances.py`) play out what it decided.

The conductor's view is fed exactly as live: heartbeats every simulated second,
KV events (applied to the index the moment a cache changes), and one progress
report per first token and per finished request. Deterministic for a seed:
events at equal times run in the order they were scheduled.
"""

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from libs.engine.cost_model import CostModel, reference_coefficients
from libs.protocol.schema import AdmitRequest, CostCoefficients
from libs.protocol.slo import SLO
from services.conductor.admission_policy import AdmitAll, build_policy
from services.conductor.admitter import Admitter, AdmitterConfig
from services.conductor.cluster import ClusterView
from services.conductor.fair_share import FairShareConfig
from services.conductor.index import KVIndex
from services.conductor.overload import OverloadConfig
from services.conductor.predict import PredictConfig
from services.conductor.simulator.instances import SimDecode, SimPrefill, SimRequest, SimStore
from services.conductor.simulator.trace import TRACE_BLOCK_SIZE, TraceRequest


@dataclass(frozen=True)
class SimConfig:
    num_prefill: int
    num_decode: int
    policy: str
    seed: int = 0
    slo: SLO = SLO()
    coefficients: CostCoefficients = field(default_factory=reference_coefficients)
    prefill_cache_blocks: int = 2_000  # per prefill instance
    store_blocks: int = 50_000  # 0: no store
    decode_max_batch: int = 256
    decode_kv_tokens: int = 1_500_000
    decode_chunk_tokens: int | None = 512  # the most prompt tokens a decode instance prefills between two steps
    prefill_contended_tokens: int = 512  # a chunk not favored while favored work is about (prefill_order.step); 0: off
    noise: float = 0.1  # actual durations = predicted x lognormal(0, noise)
    slowdown: float = 1.0  # the instances run this many times slower than the cost model they report
    heartbeat_interval: float = 1.0
    balancing_threshold: float = 2.0
    expected_output_tokens: int = 512
    max_band_refusal_ratio: float = 3.0  # the overload guard (services/conductor/overload.py); 0: no preference
    fair_share_pressure: float = 0.5  # tenants' shares under overload (services/conductor/fair_share.py); 1: off

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("a simulated cluster needs at least one prefill and one decode instance")
        if self.slowdown <= 0:
            raise ValueError(f"the slowdown must be positive, got {self.slowdown}")
        if self.coefficients.block_size != TRACE_BLOCK_SIZE:
            raise ValueError(f"the cost model's block size must be the trace's ({TRACE_BLOCK_SIZE} tokens)")


@dataclass
class Sample:
    """The cluster at one heartbeat."""

    time: float
    prefill_queue: int  # requests queued or prefilling
    decode_batch: int  # sequences decoding or waiting to
    rejected: int  # so far
    wasted: int  # so far


@dataclass
class SimResult:
    config: SimConfig
    requests: list[SimRequest]
    samples: list[Sample]
    duration_s: float  # simulated: first arrival to last event
    prediction_mean_abs_error_s: float
    prefill_busy_s: float


class Simulation:
    def __init__(self, config: SimConfig, trace: list[TraceRequest]) -> None:
        self.config = config
        self.trace = trace
        self.now = 0.0
        self._events: list[tuple] = []
        self._seq = 0
        self._noise_rng = random.Random(config.seed * 7919 + 1)
        cost = CostModel(slowed(config.coefficients, config.slowdown))
        self.reported = config.coefficients  # what the instances tell the conductor
        self.index = KVIndex()
        self.view = ClusterView(timeout=3 * config.heartbeat_interval, clock=lambda: self.now, block_size=TRACE_BLOCK_SIZE)
        policy = build_policy(config.policy, random.Random(config.seed))
        self.admission = not isinstance(policy.admission, AdmitAll)
        predict = PredictConfig(TRACE_BLOCK_SIZE, config.balancing_threshold, config.expected_output_tokens)
        overload = OverloadConfig(config.max_band_refusal_ratio)
        fair = FairShareConfig(config.fair_share_pressure)
        self.scheduler = Admitter(policy, self.view, self.index,
                                   AdmitterConfig(config.slo, predict, overload=overload, fair_share=fair))
        self.prefills = {f"prefill-{i}": SimPrefill(self, f"prefill-{i}", cost, config.prefill_cache_blocks,
                                                    contended_tokens=config.prefill_contended_tokens)
                         for i in range(config.num_prefill)}  # fmt: skip
        self.decodes = {f"decode-{i}": SimDecode(self, f"decode-{i}", cost, config.decode_max_batch,
                                                 config.decode_kv_tokens, config.decode_chunk_tokens)
                        for i in range(config.num_decode)}  # fmt: skip
        self.store = (SimStore("store-0", config.store_blocks, cost, CostModel(config.coefficients))
                      if config.store_blocks > 0 else None)  # fmt: skip
        self.requests: list[SimRequest] = []
        self.samples: list[Sample] = []
        self._open = 0  # admitted requests not yet over
        self._rejected = self._wasted = 0

    # --- the loop --------------------------------------------------------------------
    def schedule(self, at: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, fn, args))

    def noise(self) -> float:
        return math.exp(self._noise_rng.gauss(0.0, self.config.noise)) if self.config.noise > 0 else 1.0

    def run(self) -> SimResult:
        self._heartbeats()
        arrivals = iter(self.trace)
        upcoming = next(arrivals, None)
        events = self._events
        while upcoming is not None or events:
            if upcoming is not None and (not events or upcoming.arrival_s <= events[0][0]):
                self.now = upcoming.arrival_s
                self._arrive(upcoming)
                upcoming = next(arrivals, None)
                continue
            at, _, fn, args = heapq.heappop(events)
            self.now = at
            fn(*args)
            if upcoming is None and self._open == 0:
                break  # only heartbeats are left
        return SimResult(
            self.config, self.requests, self.samples, self.now, self.scheduler.errors.mean_abs,
            sum(p.busy_seconds for p in self.prefills.values()),
        )

    def _heartbeats(self) -> None:
        self.view.observe_all([instance.heartbeat() for instance in
                               (*self.prefills.values(), *self.decodes.values(), *([self.store] if self.store else []))])
        self.samples.append(Sample(
            self.now, sum(len(p.jobs) for p in self.prefills.values()),
            sum(d.num_sequences for d in self.decodes.values()), self._rejected, self._wasted,
        ))  # fmt: skip
        self.schedule(self.now + self.config.heartbeat_interval, self._heartbeats)

    # --- a request's life ---------------------------------------------------------------
    def _arrive(self, t: TraceRequest) -> None:
        request = SimRequest(t, str(t.index))
        self.requests.append(request)
        admit = AdmitRequest(request_id=request.request_id, num_prompt_tokens=t.input_length,
                             max_tokens=t.output_length, block_hashes=list(t.hash_ids), tenant=t.tenant,
                             tenant_weight=t.weight)  # fmt: skip
        decision = request.decision = self.scheduler.admit(admit)
        if not decision.admitted:
            request.outcome, request.reason = "rejected", decision.reason or decision.error_code
            self._rejected += 1
            return
        self._open += 1
        if decision.prefill_on_decode:
            self.decodes[decision.decode_id].prefill_locally(request)
        else:
            self.prefills[decision.prefill_id].submit(request)

    def prefilled(self, request: SimRequest) -> None:
        """Its first token is out and its KV goes to its decode instance."""
        t = request.trace
        request.first_token = self.now
        self.scheduler.first_token(request.request_id, request.ttft)
        if t.output_length < 2:
            self.finished(request)
            return
        request.remaining, request.context = t.output_length - 1, t.input_length + 1
        decode = self.decodes[request.decision.decode_id]
        if self.admission and decode.would_refuse(request, self.config.slo.tbt_s):
            request.outcome, request.reason = "wasted", "refused_by_decode"
            self._wasted += 1
            self._end(request)
            return
        decode.hand_over(request)

    def prefilled_locally(self, request: SimRequest, at: float) -> bool:
        """A decode instance prefilled it itself, first token at ``at``; True: it decodes on."""
        t = request.trace
        request.first_token = at
        self.schedule(at, self.scheduler.first_token, request.request_id, request.ttft)
        if t.output_length < 2:
            self.schedule(at, self.finished, request)
            return False
        request.remaining, request.context = t.output_length - 1, t.input_length + 1
        return True

    def finished(self, request: SimRequest) -> None:
        request.outcome, request.finish = "done", self.now
        self._end(request)

    def _end(self, request: SimRequest) -> None:
        tokens = request.trace.output_length if request.outcome == "done" else 0
        self.scheduler.finished(request.request_id, tokens)
        self._open -= 1


def slowed(c: CostCoefficients, factor: float) -> CostCoefficients:
    """``c`` with every duration ``factor`` times longer."""
    if factor == 1.0:
        return c
    times = ("prefill_base", "prefill_per_token", "prefill_per_token_context", "decode_base", "decode_per_seq",
             "decode_per_context_token", "transfer_per_block")  # fmt: skip
    return msgspec.structs.replace(c, **{k: getattr(c, k) * factor for k in times},
                                   load_per_block={t: v * factor for t, v in c.load_per_block.items()})  # fmt: skip


def simulate(config: SimConfig, trace: list[TraceRequest]) -> SimResult:
    return Simulation(config, trace).run()
