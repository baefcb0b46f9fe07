"""The conductor's decision core: one `admit` per request and one `progress` per
milestone of an admitted request, over the cluster view and the KV index.

The live service (`app.py`) and the simulator drive the same Scheduler: the
former from NATS messages, the latter from simulated instances. It books each
admission into the chosen instances' predicted load (`load.py`) and settles it
when the request's first token and its end are reported, measuring the error
of every TTFT and TBT prediction on the way: as histograms, and as the ratios
admission's safety margins are learned from (`margin.py`).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from libs.common.schema import AdmitRequest
from libs.common.vocabulary import Role
from services.conductor.admission import Policy
from services.conductor.affinity import Home, SessionTable
from services.conductor.cluster import ClusterView
from services.conductor.index import KVIndex
from services.conductor.margin import MarginConfig, Margins
from services.conductor.policies import Decision
from services.conductor.predict import SLO, AdmitContext, PredictConfig, modelled_step


@dataclass(frozen=True)
class SchedulerConfig:
    slo: SLO = SLO(ttft_s=2.0, tbt_s=0.15)
    predict: PredictConfig = field(default_factory=PredictConfig)
    margin: MarginConfig = field(default_factory=MarginConfig)


@dataclass
class Admitted:
    prefill_id: str  # where its prefill runs (the decode worker itself under conditional disaggregation)
    decode_id: str
    predicted_ttft_s: float
    predicted_tbt_s: float | None
    admitted_at: float
    first_token_at: float | None = None
    modelled_at_first_s: float = 0.0  # its decode instance's `DecodeLoad.modelled_s` at its first token


# prediction error buckets, seconds (actual - predicted; negative: it came early)
ERROR_BUCKETS = (-5.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
TBT_ERROR_BUCKETS = (-0.1, -0.05, -0.02, -0.01, -0.005, 0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


@dataclass
class PredictionErrors:
    """A prediction's error: a histogram of actual - predicted, and its absolute sum."""

    bounds: tuple[float, ...] = ERROR_BUCKETS
    what: str = "TTFT"
    buckets: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0
    sum_abs: float = 0.0

    def __post_init__(self) -> None:
        self.buckets = self.buckets or [0] * (len(self.bounds) + 1)

    def observe(self, error_s: float) -> None:
        i = next((k for k, bound in enumerate(self.bounds) if error_s <= bound), len(self.bounds))
        self.buckets[i] += 1
        self.count += 1
        self.sum += error_s
        self.sum_abs += abs(error_s)

    @property
    def mean_abs(self) -> float:
        return self.sum_abs / self.count if self.count else 0.0

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) for each bucket, the last bound inf."""
        running, out = 0, []
        for bound, n in zip([*self.bounds, float("inf")], self.buckets):
            running += n
            out.append((bound, running))
        return out


class Scheduler:
    def __init__(self, policy: Policy, view: ClusterView, index: KVIndex, config: SchedulerConfig | None = None) -> None:
        self.policy = policy
        self.view = view
        self.index = index
        self.config = config or SchedulerConfig()
        self.admitted: dict[str, Admitted] = {}
        self.errors = PredictionErrors()
        self.tbt_errors = PredictionErrors(TBT_ERROR_BUCKETS, "TBT")
        self.margins = Margins(self.config.margin)
        self.sessions = SessionTable()
        self.num_admitted = 0
        self.rejections: dict[str, int] = {}  # by error code or rejection reason
        self.explain: Callable[[AdmitContext, Decision], None] | None = None  # told of every choice (the console)

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
            margins=self.margins,
        )  # fmt: skip

    def admit(self, request: AdmitRequest) -> Decision:
        ctx = self.context(request)
        decision = self.policy.choose(ctx, self.sessions.get(request.session_id))
        if self.explain is not None:
            self.explain(ctx, decision)
        if not decision.admitted:
            key = decision.reason or decision.error_code
            self.rejections[key] = self.rejections.get(key, 0) + 1
            return decision
        self.num_admitted += 1
        now = ctx.now
        prefill, decode = self.view.get(decision.prefill_id), self.view.get(decision.decode_id)
        prefill.prefill.add(request.request_id, decision.work_s, now, decision.prefill_speed)
        decode.decode.add(request.request_id, ctx.num_tokens, now + decision.predicted_ttft_s, request.max_tokens,
                          ctx.expected_output_tokens)  # fmt: skip
        self.view.assigned(decision.prefill_id)
        if decision.decode_id != decision.prefill_id:
            self.view.assigned(decision.decode_id)
        if request.session_id is not None:
            self.sessions.set(request.session_id, Home(decision.prefill_id, decision.decode_id))
        self.admitted[request.request_id] = Admitted(
            decision.prefill_id, decision.decode_id, decision.predicted_ttft_s, decision.predicted_tbt_s, now
        )
        return decision

    def first_token(self, request_id: str, ttft_s: float | None = None) -> None:
        """The request's prefill is done; ``ttft_s`` as measured, when known."""
        record = self.admitted.get(request_id)
        if record is None or record.first_token_at is not None:
            return
        now = record.first_token_at = self.view.clock()
        if (prefill := self.view.get(record.prefill_id)) is not None:
            served = prefill.prefill.done(request_id, now)
            if served is not None and served.measured_s is not None:
                self.margins.observe_prefill(record.prefill_id, served.measured_s, served.predicted_s)
        if (decode := self.view.get(record.decode_id)) is not None:
            record.modelled_at_first_s = decode.decode.advance(now)
            decode.decode.started(request_id, now)
            decode.decode.set_step(modelled_step(decode, now))
        measured = ttft_s if ttft_s is not None else now - record.admitted_at
        self.errors.observe(measured - record.predicted_ttft_s)
        self.margins.observe_ttft(record.prefill_id, measured, record.predicted_ttft_s)

    def finished(self, request_id: str, num_output_tokens: int = 0) -> None:
        """The request is over (done, failed, cancelled or refused by its decode instance),
        after ``num_output_tokens`` tokens (0: not known): its mean TBT settles that prediction."""
        record = self.admitted.pop(request_id, None)
        if record is None:
            return
        now = self.view.clock()
        decode = self.view.get(record.decode_id)
        modelled = decode.decode.advance(now) if decode is not None else None
        if record.first_token_at is not None and num_output_tokens >= 2 and now > record.first_token_at:
            measured = (now - record.first_token_at) / (num_output_tokens - 1)
            if record.predicted_tbt_s:
                self.tbt_errors.observe(measured - record.predicted_tbt_s)
            if modelled is not None and modelled > record.modelled_at_first_s:
                # against the steps the model gives the batch it ran in (which later admissions
                # were allowed to grow up to the SLO), not the batch it was admitted into
                model_tbt = (modelled - record.modelled_at_first_s) / (now - record.first_token_at)
                self.margins.observe_tbt(record.decode_id, measured, model_tbt)
        if (prefill := self.view.get(record.prefill_id)) is not None:
            prefill.prefill.done(request_id, now)
        if decode is not None:
            decode.decode.done(request_id)
            decode.decode.set_step(modelled_step(decode, now))
