"""The conductor's decision core: one `admit` per request and one `progress` per
milestone of an admitted request, over the cluster view and the KV index.

The live service (`app.py`) and the simulator drive the same Admitter: the
former from NATS messages, the latter from simulated instances. It books each
admission into the chosen instances' predicted load (`load.py`) and settles it
when the request's first token and its end are reported, measuring the error
of every TTFT and TBT prediction on the way: as histograms, and as the ratios
admission's safety margins are learned from (`margin.py`).
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from libs.protocol.ids import RequestId
from libs.protocol.schema import AdmitRequest
from libs.protocol.slo import SLO
from libs.protocol.vocabulary import ErrorCode, Role
from services.conductor.admission_policy import Policy
from services.conductor.affinity import Home, SessionTable
from services.conductor.candidates import Candidates
from services.conductor.cluster import ClusterView
from services.conductor.fair_share import FairShare, FairShareConfig
from services.conductor.index import KVIndex
from services.conductor.margin import MarginConfig, Margins
from services.conductor.overload import Overload, OverloadConfig
from services.conductor.predict import AdmitContext, PredictConfig, modelled_step
from services.conductor.routers import Decision


@dataclass(frozen=True)
class AdmitterConfig:
    slo: SLO = SLO()
    predict: PredictConfig = field(default_factory=PredictConfig)
    margin: MarginConfig = field(default_factory=MarginConfig)
    overload: OverloadConfig = field(default_factory=OverloadConfig)
    fair_share: FairShareConfig = field(default_factory=FairShareConfig)


@dataclass(frozen=True)
class Booking:
    """What an admission adds to its instances' predicted load: one made here, or a
    peer replica's (`replicas.py`), which is booked and settled the same way."""

    request_id: RequestId
    prefill_id: str  # where its prefill runs (the decode worker itself under conditional disaggregation)
    decode_id: str
    work_s: float  # predicted seconds it adds to the prefill queue
    prefill_speed: float
    num_prompt_tokens: int
    max_tokens: int
    expected_output_tokens: int
    predicted_ttft_s: float
    predicted_tbt_s: float | None
    session_id: str | None = None
    deadline_in_s: float | None = None  # its prefill is due this long after admission; None: best effort
    moved: bool = False  # continued after a lost worker: its latencies teach the margins nothing
    num_sequences: int = 1  # n: sequences it decodes, each a member of the batch
    favored: bool = False  # its prefill goes before the other jobs of its kind (fair_share.py)


# Samples taken this close to a fault (an instance restarted or gone) or after it say
# more about the fault than about the predictions: the margins do not learn from them.
FAULT_GRACE_S = 10.0


@dataclass
class Admitted:
    booking: Booking
    admitted_at: float
    origin: str | None = None  # the peer replica that admitted it; None: this one
    first_token_at: float | None = None
    modelled_at_first_s: float = 0.0  # its decode instance's `DecodeLoad.modelled_s` at its first token

    @property
    def prefill_id(self) -> str:
        return self.booking.prefill_id

    @property
    def decode_id(self) -> str:
        return self.booking.decode_id

    @property
    def predicted_ttft_s(self) -> float:
        return self.booking.predicted_ttft_s

    @property
    def predicted_tbt_s(self) -> float | None:
        return self.booking.predicted_tbt_s


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


class Admitter:
    def __init__(self, policy: Policy, view: ClusterView, index: KVIndex, config: AdmitterConfig | None = None) -> None:
        self.policy = policy
        self.view = view
        self.index = index
        self.config = config or AdmitterConfig()
        self.admitted: dict[str, Admitted] = {}
        self.errors = PredictionErrors()
        self.tbt_errors = PredictionErrors(TBT_ERROR_BUCKETS, "TBT")
        self.margins = Margins(self.config.margin, lambda: view.clock())
        self.candidates = Candidates(view, self.margins)  # the instances a router must look at
        self.overload = Overload(self.config.overload)
        self.fair_share = FairShare(self.config.fair_share)
        self.sessions = SessionTable()
        self.num_admitted = 0
        self.rejections: dict[str, int] = {}  # by error code or rejection reason
        self.explain: Callable[[AdmitContext, Decision], None] | None = None  # told of every choice (the console)

    def context_slo(self, request: AdmitRequest) -> SLO:
        """The targets ``request`` is judged by: its own where it set them, else the default."""
        slo = self.config.slo
        if request.slo_ttft_s is not None or request.slo_tbt_s is not None:
            slo = slo.overridden(request.slo_ttft_s, request.slo_tbt_s)
        return slo

    def context(self, request: AdmitRequest) -> AdmitContext:
        slo = self.context_slo(request)
        view = self.view
        prefills, decodes = view.alive(Role.PREFILL), view.alive(Role.DECODE)
        excluded = frozenset(request.exclude or ())
        if excluded:  # instances the gateway has seen die, before this view times them out
            prefills = [i for i in prefills if i.instance_id not in excluded]
            decodes = [i for i in decodes if i.instance_id not in excluded]
        return AdmitContext(
            request=request, match=self.index.match(request.block_hashes), view=view, now=view.clock(), slo=slo,
            config=self.config.predict, prefills=prefills, decodes=decodes, stores=view.alive(Role.STORE),
            margins=self.margins, shorter_share=self.overload.shorter_share(request.num_prompt_tokens, view.clock(),
                                                                            len(prefills)),
            candidates=self.candidates, excluded=excluded, replication=self.policy.replication,
            favored=request.tenant is not None and not (request.best_effort or request.moved)
            and self.fair_share.favors(request.tenant, request.tenant_weight, view.clock()),
        )  # fmt: skip

    def admit(self, request: AdmitRequest) -> Decision:
        ctx = self.context(request)
        decision = self.policy.choose(ctx, self.sessions.get(request.session_id))
        cost = ctx.num_tokens + ctx.expected_output_tokens * ctx.num_sequences
        if decision.admitted and request.tenant is not None and not (request.moved or request.best_effort):
            decision = self._fair(request, decision, cost, ctx.slo.ttft_s, ctx.ttft_slack, ctx.now)
        if request.tenant is not None:
            self.fair_share.arrived(request.tenant, request.tenant_weight, ctx.now)
        if self.explain is not None:
            self.explain(ctx, decision)
        if not request.best_effort:  # best effort runs in time SLO work leaves: it takes none from it
            self.overload.observe(ctx.now, ctx.num_tokens, decision.work_s, decision.admitted)
        if not decision.admitted:
            key = decision.reason or decision.error_code
            self.rejections[key] = self.rejections.get(key, 0) + 1
            return decision
        self.num_admitted += 1
        if ctx.prefill_deadline is not None:
            decision = replace(decision, prefill_deadline_s=ctx.prefill_deadline - ctx.now, favored=ctx.favored)
        booking = Booking(
            request.request_id, decision.prefill_id, decision.decode_id, decision.work_s, decision.prefill_speed,
            ctx.num_tokens, request.max_tokens, ctx.expected_output_tokens, decision.predicted_ttft_s,
            decision.predicted_tbt_s, request.session_id,
            None if ctx.prefill_deadline is None else ctx.prefill_deadline - ctx.now, request.moved,
            ctx.num_sequences, ctx.favored,
        )  # fmt: skip
        self.book(booking, ctx.now)
        if request.tenant is not None:
            self.fair_share.add(request.request_id, request.tenant, request.tenant_weight, cost, ctx.now)
        return decision

    def _fair(self, request: AdmitRequest, decision: Decision, cost: float, ttft_target_s: float, slack_s: float,
              now: float) -> Decision:  # fmt: skip
        """``decision``, or a refusal when the queue is building and its tenant is the
        furthest over its weighted share of the usage (fair_share.py)."""
        queue_s = (decision.predicted_ttft_s or 0.0) - decision.work_s  # the work ahead of it, not its own
        pressure = (queue_s + slack_s) / ttft_target_s  # slack: what the model misses
        ratio = self.fair_share.refuses(request.tenant, request.tenant_weight, cost, pressure, now)
        if ratio is None:
            return decision
        message = (f"tenant {request.tenant} is using {ratio:.1f}x its weighted share of the cluster while it is "
                   f"contended (predicted TTFT {decision.predicted_ttft_s:.3f} s of a {ttft_target_s:.3f} s target)")
        return replace(decision, error_code=ErrorCode.REJECTED, error_message=message, reason="fair_share",
                       retry_after_s=decision.predicted_ttft_s)  # fmt: skip

    def book(self, booking: Booking, now: float, origin: str | None = None) -> bool:
        """Add an admission to its instances' predicted load: this scheduler's own
        (``origin`` None) or peer replica ``origin``'s. A request booked twice (its
        gateway asked again when a replica did not answer) keeps its later booking,
        but never a peer's over this scheduler's own. False: not booked."""
        previous = self.admitted.get(booking.request_id)
        if previous is not None:
            if origin is not None and previous.origin is None:
                return False
            del self.admitted[booking.request_id]
            self._release(booking.request_id, previous, now)
        b = booking
        if (prefill := self.view.get(b.prefill_id)) is not None:  # a peer may know an instance this view does not yet
            deadline = None if b.deadline_in_s is None else now + b.deadline_in_s
            prefill.prefill.add(b.request_id, b.work_s, now, b.prefill_speed, deadline, b.favored)
        if (decode := self.view.get(b.decode_id)) is not None:
            if b.prefill_id == b.decode_id:  # prefilled between its decode steps: every member waits for it
                decode.decode.add_stall(b.work_s)
            decode.decode.add(b.request_id, b.num_prompt_tokens, now + b.predicted_ttft_s, b.max_tokens,
                              b.expected_output_tokens, b.num_sequences)  # fmt: skip
        self.view.assigned(b.prefill_id)
        if b.decode_id != b.prefill_id:
            self.view.assigned(b.decode_id)
        if b.session_id is not None:
            self.sessions.set(b.session_id, Home(b.prefill_id, b.decode_id))
        self.admitted[b.request_id] = Admitted(b, now, origin)
        return True

    @property
    def num_own(self) -> int:
        """Requests admitted here and not yet finished (the rest are peer replicas')."""
        return sum(1 for a in self.admitted.values() if a.origin is None)

    def first_token(self, request_id: RequestId, ttft_s: float | None = None) -> None:
        """The request's prefill is done; ``ttft_s`` as measured, when known."""
        record = self.admitted.get(request_id)
        if record is None or record.first_token_at is not None:
            return
        now = record.first_token_at = self.view.clock()
        if (prefill := self.view.get(record.prefill_id)) is not None:
            served = prefill.prefill.done(request_id, now)
            if served is not None and served.measured_s is not None and self._teaches(record):
                self.margins.observe_prefill(record.prefill_id, served.measured_s, served.predicted_s)
        if (decode := self.view.get(record.decode_id)) is not None:
            record.modelled_at_first_s = decode.decode.advance(now)
            decode.decode.started(request_id, now)
            decode.decode.set_step(modelled_step(decode, now))
        measured = ttft_s if ttft_s is not None else now - record.admitted_at
        if record.origin is None:  # a peer's is its own to report
            self.errors.observe(measured - record.predicted_ttft_s)
        if self._teaches(record):
            self.margins.observe_ttft(record.booking.num_prompt_tokens, measured, record.predicted_ttft_s)

    def _teaches(self, record: "Admitted") -> bool:
        """Whether a request's latencies are samples of the predictions: not a moved
        request's, nor one's that a fault (a restart, an instance gone) or an instance's start-up
        work (its heartbeats say ``warming``) may have touched."""
        return not record.booking.moved and self.view.last_disturbance < record.admitted_at - FAULT_GRACE_S

    def finished(self, request_id: RequestId, num_output_tokens: int = 0) -> None:
        """The request is over (done, failed, cancelled or refused by its decode instance),
        after ``num_output_tokens`` tokens (0: not known): its mean TBT settles that prediction."""
        self.fair_share.remove(request_id)
        record = self.admitted.pop(request_id, None)
        if record is None:
            return
        now = self.view.clock()
        decode = self.view.get(record.decode_id)
        modelled = decode.decode.advance(now) if decode is not None else None
        if record.first_token_at is not None and num_output_tokens >= 2 and now > record.first_token_at:
            measured = (now - record.first_token_at) / (num_output_tokens - 1)
            if record.predicted_tbt_s and record.origin is None:
                self.tbt_errors.observe(measured - record.predicted_tbt_s)
            if modelled is not None and modelled > record.modelled_at_first_s and self._teaches(record):
                # against the steps the model gives the batch it ran in (which later admissions
                # were allowed to grow up to the SLO), not the batch it was admitted into
                model_tbt = (modelled - record.modelled_at_first_s) / (now - record.first_token_at)
                self.margins.observe_tbt(record.decode_id, measured, model_tbt)
        self._release(request_id, record, now)

    def _release(self, request_id: RequestId, record: Admitted, now: float) -> None:
        """Take the request's booking off its instances' load."""
        if (prefill := self.view.get(record.prefill_id)) is not None:
            prefill.prefill.done(request_id, now)
        if (decode := self.view.get(record.decode_id)) is not None:
            decode.decode.done(request_id)
            decode.decode.set_step(modelled_step(decode, now))
