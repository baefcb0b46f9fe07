"""The conductor's decision core: one `admit` per request and one `progress` per
milestone of an admitted request, over the cluster view and the KV index.

The live service (`app.py`) and the simulator drive the same Scheduler: the
former from NATS messages, the latter from simulated instances. It books each
admission into the chosen instances' predicted load (`load.py`) and settles it
when the request's first token and its end are reported, measuring the error
of every TTFT prediction on the way.
"""

from dataclasses import dataclass, field

from libs.common.schema import AdmitRequest
from libs.common.vocabulary import Role
from services.conductor.admission import Policy
from services.conductor.cluster import ClusterView
from services.conductor.index import KVIndex
from services.conductor.policies import Decision
from services.conductor.predict import SLO, AdmitContext, PredictConfig


@dataclass(frozen=True)
class SchedulerConfig:
    slo: SLO = SLO(ttft_s=2.0, tbt_s=0.15)
    predict: PredictConfig = field(default_factory=PredictConfig)


@dataclass
class Admitted:
    prefill_id: str  # where its prefill runs (the decode worker itself under conditional disaggregation)
    decode_id: str
    predicted_ttft_s: float
    admitted_at: float


# TTFT prediction error buckets, seconds (actual - predicted; negative: it came early)
ERROR_BUCKETS = (-5.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


@dataclass
class PredictionErrors:
    """TTFT prediction error: a histogram of actual - predicted, and its absolute sum."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(ERROR_BUCKETS) + 1))
    count: int = 0
    sum: float = 0.0
    sum_abs: float = 0.0

    def observe(self, error_s: float) -> None:
        i = next((k for k, bound in enumerate(ERROR_BUCKETS) if error_s <= bound), len(ERROR_BUCKETS))
        self.buckets[i] += 1
        self.count += 1
        self.sum += error_s
        self.sum_abs += abs(error_s)

    @property
    def mean_abs(self) -> float:
        return self.sum_abs / self.count if self.count else 0.0

    def render(self, name: str = "kvserve_conductor_ttft_prediction_error_seconds") -> str:
        """The Prometheus text format (the cumulative histogram of actual - predicted)."""
        lines = [f"# HELP {name} TTFT measured minus TTFT predicted at admission", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip([*ERROR_BUCKETS, float("inf")], self.buckets):
            running += n
            lines.append(f'{name}_bucket{{le="{"+Inf" if bound == float("inf") else f"{bound:g}"}"}} {running}')
        lines += [f"{name}_sum {self.sum:g}", f"{name}_count {self.count}",
                  f"# TYPE {name}_abs_sum counter", f"{name}_abs_sum {self.sum_abs:g}"]  # fmt: skip
        return "\n".join(lines) + "\n"


class Scheduler:
    def __init__(self, policy: Policy, view: ClusterView, index: KVIndex, config: SchedulerConfig | None = None) -> None:
        self.policy = policy
        self.view = view
        self.index = index
        self.config = config or SchedulerConfig()
        self.admitted: dict[str, Admitted] = {}
        self.errors = PredictionErrors()
        self.num_admitted = 0
        self.rejections: dict[str, int] = {}  # by error code or rejection reason

    def context(self, request: AdmitRequest) -> AdmitContext:
        slo = self.config.slo
        if request.slo_ttft_s is not None or request.slo_tbt_s is not None:
            slo = SLO(request.slo_ttft_s or slo.ttft_s, request.slo_tbt_s or slo.tbt_s)
        view = self.view
        prefills, decodes = view.alive(Role.PREFILL), view.alive(Role.DECODE)
        if request.exclude:  # instances the gateway has seen die, before this view times them out
            excluded = set(request.exclude)
            prefills = [i for i in prefills if i.instance_id not in excluded]
            decodes = [i for i in decodes if i.instance_id not in excluded]
        return AdmitContext(
            request=request, match=self.index.match(request.block_hashes), view=view, now=view.clock(), slo=slo,
            config=self.config.predict, prefills=prefills, decodes=decodes, stores=view.alive(Role.STORE),
        )  # fmt: skip

    def admit(self, request: AdmitRequest) -> Decision:
        ctx = self.context(request)
        decision = self.policy.choose(ctx)
        if not decision.admitted:
            key = decision.reason or decision.error_code
            self.rejections[key] = self.rejections.get(key, 0) + 1
            return decision
        self.num_admitted += 1
        now = ctx.now
        prefill, decode = self.view.get(decision.prefill_id), self.view.get(decision.decode_id)
        prefill.prefill.add(request.request_id, decision.work_s, now)
        decode.decode.add(request.request_id, ctx.num_tokens, now + decision.predicted_ttft_s, request.max_tokens,
                          ctx.expected_output_tokens)  # fmt: skip
        self.view.assigned(decision.prefill_id)
        if decision.decode_id != decision.prefill_id:
            self.view.assigned(decision.decode_id)
        self.admitted[request.request_id] = Admitted(
            decision.prefill_id, decision.decode_id, decision.predicted_ttft_s, now
        )
        return decision

    def first_token(self, request_id: str, ttft_s: float | None = None) -> None:
        """The request's prefill is done; ``ttft_s`` as measured, when known."""
        record = self.admitted.get(request_id)
        if record is None:
            return
        now = self.view.clock()
        if (prefill := self.view.get(record.prefill_id)) is not None:
            prefill.prefill.done(request_id, now)
        if (decode := self.view.get(record.decode_id)) is not None:
            decode.decode.started(request_id, now)
        measured = ttft_s if ttft_s is not None else now - record.admitted_at
        self.errors.observe(measured - record.predicted_ttft_s)

    def finished(self, request_id: str) -> None:
        """The request is over (done, failed, cancelled or refused by its decode instance)."""
        record = self.admitted.pop(request_id, None)
        if record is None:
            return
        now = self.view.clock()
        if (prefill := self.view.get(record.prefill_id)) is not None:
            prefill.prefill.done(request_id, now)
        if (decode := self.view.get(record.decode_id)) is not None:
            decode.decode.done(request_id)
