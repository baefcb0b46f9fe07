"""Hand-built cluster states for the conductor's tests: a fixed clock, round-number
cost models, heartbeats and an index filled by hand."""

from libs.protocol.schema import ROLE_BEATS, AdmitRequest, CostCoefficients, Heartbeat
from libs.protocol.slo import SLO
from libs.protocol.vocabulary import Role
from services.conductor.admitter import AdmitterConfig
from services.conductor.cluster import ClusterView
from services.conductor.index import KVIndex
from services.conductor.predict import PredictConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def coefficients(**overrides) -> CostCoefficients:
    """Prefill 1 ms a token, decode steps of 10 ms + 1 ms a sequence, free copies."""
    fields = dict(block_size=16, prefill_base=0.0, prefill_per_token=0.001, prefill_per_token_context=0.0,
                  decode_base=0.01, decode_per_seq=0.001, decode_per_context_token=0.0, transfer_per_block=0.0)  # fmt: skip
    return CostCoefficients(**{**fields, **overrides})


def beat(instance_id: str, role: str, load: int = 0, free: int = 100, started_at: float = 0.0, warming: bool = False,
         **fields) -> Heartbeat:  # fmt: skip
    """A worker's (or store's) heartbeat; ``fields`` go in its role's payload."""
    fields.setdefault("cost", coefficients())
    payload = ROLE_BEATS[Role(role)](free_blocks=free, **fields, **({"load": load} if role != Role.STORE else {}))
    return Heartbeat(instance_id=instance_id, role=role, host_id="h", started_at=started_at, warming=warming,
                     payload=payload)  # fmt: skip


def block(i: int) -> bytes:
    return bytes([i]) * 16


PROMPT = [block(i) for i in range(10)]  # 170 tokens: 10 full blocks usable


def request(request_id: str = "r", tokens: int = 170, blocks: list[bytes] | None = None, max_tokens: int = 10,
            **fields) -> AdmitRequest:  # fmt: skip
    return AdmitRequest(request_id=request_id, num_prompt_tokens=tokens, max_tokens=max_tokens,
                        block_hashes=PROMPT if blocks is None else blocks, **fields)  # fmt: skip


def cluster(*beats: Heartbeat) -> tuple[ClusterView, KVIndex, Clock]:
    clock = Clock()
    view = ClusterView(timeout=3.0, clock=clock)
    for hb in beats:
        view.observe(hb)
    return view, KVIndex(), clock


def config(ttft_s: float = 2.0, tbt_s: float = 0.15, threshold: float = 2.0) -> AdmitterConfig:
    return AdmitterConfig(SLO(ttft_s, tbt_s), PredictConfig(block_size=16, balancing_threshold=threshold,
                                                              expected_output_tokens=512))  # fmt: skip
