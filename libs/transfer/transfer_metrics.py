"""What a transfer engine counts, per transport: bytes, transfers, their durations and
failures by cause; and what its TCP listener refuses or closes. One `TransferMetrics`
per engine, declared on the process's `Metrics` (a private one when none is given)."""

from collections.abc import Sequence

from libs.common.metrics import FAST_BUCKETS, Metrics
from libs.transfer.descriptors import CAUSES
from libs.transfer.tickets import Refusal


class TransferMetrics:
    def __init__(self, metrics: Metrics | None = None, transports: Sequence[str] = ()) -> None:
        """``transports``: the names whose series are in the scrape, at zero, from the start."""
        m = metrics if metrics is not None else Metrics()
        self.bytes = m.counter("kvserve_transfer_bytes_total", "KV bytes moved by transfers that succeeded, sent side",
                               ["transport"], transports)  # fmt: skip
        self.transfers = m.counter("kvserve_transfers_total", "Transfers that succeeded", ["transport"], transports)
        self.seconds = m.histogram("kvserve_transfer_duration_seconds", "How long a successful transfer took",
                                   FAST_BUCKETS, ["transport"], transports)  # fmt: skip
        self.failures = m.counter("kvserve_transfer_failures_total", "Transfers that failed, by transport and cause",
                                  ["transport", "cause"], [(t, c) for t in transports for c in CAUSES])  # fmt: skip
        self.received = m.counter("kvserve_transfer_received_bytes_total", "KV bytes received by the TCP listener")
        self.refused = m.counter("kvserve_transfer_refused_total",
                                 "TCP transfer connections, greetings and frames refused, by reason",
                                 ["reason"], list(Refusal))  # fmt: skip
        self.idle_closed = m.counter("kvserve_transfer_idle_closed_total", "TCP transfer connections closed for idling")

    def succeeded(self, transport: str, nbytes: int, seconds: float) -> None:
        self.bytes.labels(transport).inc(nbytes)
        self.transfers.labels(transport).inc()
        self.seconds.labels(transport).observe(seconds)
