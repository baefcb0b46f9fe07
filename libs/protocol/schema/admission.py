"""The conductor's messages: admission requests and decisions, request progress."""

from typing import Literal

import msgspec

from libs.protocol.hashing import BlockHash
from libs.protocol.ids import InstanceId, RequestId
from libs.protocol.schema.codec import Message
from libs.protocol.vocabulary import KVTier


class AdmitRequest(Message):
    request_id: RequestId
    num_prompt_tokens: int
    max_tokens: int
    block_hashes: list[BlockHash] = msgspec.field(default_factory=list)
    slo_ttft_s: float | None = None  # None: the conductor's default
    slo_tbt_s: float | None = None
    exclude: list[InstanceId] = msgspec.field(default_factory=list)  # instances not to route to (seen dead by the gateway)
    session_id: str | None = None  # a conversation's turns: kept where its KV is unless moving is predicted cheaper
    best_effort: bool = False  # no SLO: served only in time SLO work does not need, never refused as unattainable
    moved: bool = False  # a request continued after its worker was lost: never refused, and no sample for the margins
    tenant: str | None = None  # who sent it (the gateway's tenants file): under overload, shares are by tenant
    tenant_weight: float = 1.0  # its tenant's weight: its share of a contended cluster, relative to the others'
    num_sequences: int = 1  # n: one prefill, then this many sequences decoding in the batch


class AdmitReply(Message):
    prefill_id: InstanceId
    decode_id: InstanceId
    prefill_on_decode: bool = False  # conditional disaggregation: the decode worker prefills it itself
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    cached_tokens: dict[KVTier, int] = msgspec.field(default_factory=dict)  # predicted reuse, by tier
    # its prefill is due this long after the admission (its TTFT target, less the conductor's slack for
    # what happens outside the prefill); None: best effort
    prefill_deadline_s: float | None = None
    favored: bool = False  # its tenant is under its weighted share while another is over: its prefill goes first


class ConductorAdmission(Message):
    """Conductor replica -> every replica: an admission it made and the load it books
    on its instances, which each peer books into its own view as if it had made it."""

    conductor_id: InstanceId  # the replica that admitted it
    request_id: RequestId
    prefill_id: InstanceId
    decode_id: InstanceId
    work_s: float  # predicted seconds it adds to the prefill queue
    prefill_speed: float  # the prefill instance's learned slowness, already in work_s
    num_prompt_tokens: int
    max_tokens: int
    expected_output_tokens: int
    predicted_ttft_s: float
    predicted_tbt_s: float | None = None
    session_id: str | None = None
    deadline_in_s: float | None = None  # its prefill is due this long after the admission; None: best effort
    moved: bool = False
    num_sequences: int = 1
    favored: bool = False


class RequestProgress(Message):
    """Gateway -> conductor: how an admitted request went, to settle the
    conductor's predictions (queues, decode load) and measure their error."""

    request_id: RequestId
    kind: Literal["first_token", "finished"]
    ttft_s: float | None = None  # first_token: measured from admission
    num_output_tokens: int = 0
