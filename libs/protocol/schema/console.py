"""The console: a conductor's view of its decisions, for the gateway's /console."""

import msgspec

from libs.protocol.ids import InstanceId, RequestId
from libs.protocol.schema.codec import Message
from libs.protocol.vocabulary import KVTier, Role


class ConductorViewRequest(Message):
    max_decisions: int = 50  # the most recent routing decisions, newest first
    max_prefixes: int = 10  # the hottest reused prefixes


class CandidateView(msgspec.Struct, kw_only=True):
    """One instance a decision weighed, with what was predicted for the request there."""

    instance_id: InstanceId
    role: Role
    predicted_ttft_s: float | None = None  # a prefill candidate: queue + load + compute + hand-off
    queue_s: float | None = None
    cached_tokens: int = 0  # a prefill candidate: prompt tokens it would reuse
    predicted_tbt_s: float | None = None  # a decode candidate: its step time with the request added
    batch_size: int = 0


class DecisionView(msgspec.Struct, kw_only=True):
    """One admission: the pair chosen (or the rejection and why) and every candidate."""

    request_id: RequestId
    at: float  # wall-clock seconds
    policy: str
    prefill_id: InstanceId | None = None
    decode_id: InstanceId | None = None
    prefill_on_decode: bool = False
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    cached_tokens: dict[KVTier, int] = msgspec.field(default_factory=dict)
    candidates: list[CandidateView] = msgspec.field(default_factory=list)
    rejected: str | None = None  # the error code or rejection reason
    why: str | None = None  # the rejection's explanation
    affinity: str | None = None  # a session's turn: whether it stayed where its last turn ran, and why


class PrefixView(msgspec.Struct, kw_only=True):
    """A reused prompt prefix (named by its last block's hash) and where its copies are."""

    block_hash: str  # hex
    num_blocks: int
    hits: int  # admissions that found it held somewhere
    holders: dict[InstanceId, KVTier] = msgspec.field(default_factory=dict)  # fastest tier of its last block


class LearnedView(msgspec.Struct, kw_only=True):
    """What a conductor has learned of its predictions' errors (`services/conductor/margin.py`)."""

    ttft_slack_s: dict[str, float] = msgspec.field(default_factory=dict)  # per prompt-size band, seconds added
    tbt_margins: dict[InstanceId, float] = msgspec.field(default_factory=dict)  # per decode instance, a factor
    prefill_speeds: dict[InstanceId, float] = msgspec.field(default_factory=dict)  # per prefill instance, measured


class ConductorViewReply(Message):
    instance_id: InstanceId
    policy: str
    slo_ttft_s: float
    slo_tbt_s: float
    learned: LearnedView = msgspec.field(default_factory=LearnedView)
    blocks: dict[InstanceId, dict[KVTier, int]] = msgspec.field(default_factory=dict)  # the KV index, counted
    hot_prefixes: list[PrefixView] = msgspec.field(default_factory=list)
    decisions: list[DecisionView] = msgspec.field(default_factory=list)
