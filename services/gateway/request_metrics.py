"""What the gateway measures of every request it ran, as its clients see it: TTFT,
inter-token latency, end-to-end latency and queue time (histograms, vLLM's names and
meanings), tokens, finish reasons, migrations, and whether each request met its SLOs.

`RequestMetrics.observe` is a `Generations` observer: it is told of every admitted
request once it is over, and reads the times its run recorded. A request refused at
admission never gets here (the conductor counts those, kvserve_requests_rejected_total).
"""

from itertools import pairwise

from libs.common.metrics import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS, Metrics
from libs.protocol.slo import SLO
from libs.protocol.vocabulary import FinishReason
from services.gateway.generation import Generation

SLOS = ("ttft", "tpot", "all")  # the `slo` label: each target, and both at once (goodput)
ERROR = "error"  # TextStream's finish reason for a request that failed


class RequestMetrics:
    def __init__(self, metrics: Metrics, targets: SLO) -> None:  # the defaults, as the conductor's
        m = metrics
        self.targets = targets
        self.ttft = m.histogram("kvserve_time_to_first_token_seconds",
                                "Seconds from a request's admission call to its first token reaching the gateway",
                                TTFT_BUCKETS)  # fmt: skip
        self.itl = m.histogram("kvserve_inter_token_latency_seconds",
                               "Seconds between successive deliveries of a request's generated tokens", ITL_BUCKETS)
        self.e2e = m.histogram("kvserve_e2e_request_latency_seconds",
                               "Seconds from a request's admission call to its end", REQUEST_BUCKETS)
        self.queue = m.histogram("kvserve_request_queue_time_seconds",
                                 "Seconds from a request's admission call until a prefill worker took it "
                                 "(the conductor's decision, and waits for a worker when one was missing)",
                                 TTFT_BUCKETS)  # fmt: skip
        self.success = m.counter("kvserve_request_success_total",
                                 "Requests that ended without an error, by finish reason (abort: the client left)",
                                 ["finish_reason"], list(FinishReason))  # fmt: skip
        self.errors = m.counter("kvserve_request_errors_total", "Admitted requests that ended in an error")
        self.prompt_tokens = m.counter("kvserve_prompt_tokens_total", "Prompt tokens of the requests that ended")
        self.cached_tokens = m.counter("kvserve_prompt_cached_tokens_total",
                                       "Prompt tokens whose KV was reused rather than computed, as the workers reported")
        self.generation_tokens = m.counter("kvserve_generation_tokens_total", "Tokens generated for requests")
        self.migrations = m.counter("kvserve_request_migrations_total",
                                    "Times a request moved to other workers because one serving it was gone")
        self.slo_met = m.counter("kvserve_slo_met_total",
                                 "Requests that met a latency target (slo=all: every target; goodput)", ["slo"], SLOS)
        self.slo_missed = m.counter("kvserve_slo_missed_total",
                                    "Requests that missed a latency target (an error misses every one)", ["slo"], SLOS)

    def observe(self, generation: Generation) -> None:
        run, text = generation.run, generation.text
        started = generation.started_at
        ended = generation.ended_at if generation.ended_at is not None else started
        reason = text.finish_reason or FinishReason.ABORT  # no finish: the client left mid-request
        times = run.delivery_times
        self.e2e.observe(ended - started)
        if run.taken_at is not None:
            self.queue.observe(run.taken_at - started)
        ttft = times[0] - started if times else None
        if ttft is not None:
            self.ttft.observe(ttft)
        for earlier, later in pairwise(times):
            self.itl.observe(later - earlier)
        self.prompt_tokens.inc(text.num_prompt_tokens)
        self.cached_tokens.inc(text.num_cached_tokens)
        self.generation_tokens.inc(generation.usage().completion_tokens)  # every sequence's, for n > 1
        self.migrations.inc(run.migrations)
        if reason == ERROR:
            self.errors.inc()
            for slo in SLOS:
                self.slo_missed.labels(slo).inc()
            return
        self.success.labels(reason).inc()
        if reason == FinishReason.ABORT or ttft is None:
            return  # the client left: no verdict on the service
        self._judge(generation, ttft, text.num_completion_tokens, times[-1] - times[0])

    def _judge(self, generation: Generation, ttft: float, num_tokens: int, decode_s: float) -> None:
        asked = generation.slo  # the request's own targets, where it gave them
        target = self.targets.overridden(asked.ttft_s, asked.tbt_s) if asked is not None else self.targets
        verdicts = {"ttft": ttft <= target.ttft_s}
        if num_tokens >= 2:  # one token has no time per output token
            verdicts["tpot"] = decode_s / (num_tokens - 1) <= target.tbt_s
        verdicts["all"] = all(verdicts.values())
        for name, met in verdicts.items():
            (self.slo_met if met else self.slo_missed).labels(name).inc()
