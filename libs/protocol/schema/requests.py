"""A request's path, gateway -> prefill -> decode: prefill requests, decode slot
reservations, hand-offs, cancels, resends, and the token stream."""

import msgspec

from libs.protocol.hashing import BlockHash
from libs.protocol.ids import BlockId, InstanceId, RequestId
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.schema.codec import ErrorInfo, Message
from libs.protocol.schema.contracts import CacheOwner, KVContract, WriteTicket
from libs.protocol.vocabulary import FinishReason


class PrefillRequest(Message):
    request_id: RequestId
    prompt_token_ids: list[int]
    sampling: SamplingParams
    decode_id: InstanceId  # on a decode worker's own prefill subject: itself
    ttft_budget_s: float | None = None  # its first token is due this long after the worker takes it; None: best effort
    # the prompt's last tokens that an earlier attempt generated (a migrated request): the
    # penalties count them as generated, so they are rebuilt as an undisturbed run has them
    num_prior_output_tokens: int = 0
    hash_root: BlockHash | None = None  # its cache scope's root, where its block chain starts (None: ROOT, the default)
    favored: bool = False  # before the other requests of its kind (its tenant is under its share: the conductor's call)
    cache_owner: CacheOwner | None = None  # whose blocks its prompt's are, for the stores' shares (None: nobody's)


class Ack(Message):
    """Taken, as asked."""


class ResendRequest(Message):
    """Gateway -> the decode worker a request is on: publish its generated tokens from
    ``from_index`` again (a NATS outage lost some; the gateway holds those before it)."""

    request_id: RequestId
    from_index: int


class ReserveRequest(Message):
    request_id: RequestId
    num_tokens: int  # tokens whose KV will be written into the lease
    prefill_id: InstanceId
    contract: KVContract
    host_id: str | None = None  # the prefill's host for shared memory; None: it may write over TCP (the decode listens)


class ReserveReply(Message):
    block_ids: list[BlockId]
    ticket: WriteTicket  # where and how to write the KV into those blocks
    lease_seconds: float


class HandoffRequest(Message):
    """The reserved blocks hold the prompt's KV: decode the rest."""

    request_id: RequestId
    token_ids: list[int]  # prompt, then the first generated token
    num_prompt_tokens: int
    num_cached_tokens: int
    sampling: SamplingParams
    block_ids: list[BlockId]
    num_prior_output_tokens: int = 0  # as in PrefillRequest
    # n > 1: every sequence's first token, by choice (token_ids ends with the first's); the
    # decode worker forks the others from the prompt's blocks and drops those they finish
    first_token_ids: list[int] = msgspec.field(default_factory=list)
    hash_root: BlockHash | None = None  # as the PrefillRequest's


class ReleaseRequest(Message):
    request_id: RequestId


class Cancel(Message):
    request_id: RequestId
    reason: str = "cancelled"


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One generated token's log-probability and its likeliest alternatives'."""

    logprob: float
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)


class TokenChunk(Message):
    request_id: RequestId
    index: int  # position of token_ids[0] among the generated tokens
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked for them
    choice: int = 0  # which of the request's n sequences (an error chunk ends them all)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    instance_id: InstanceId | None = None  # the worker that produced the chunk
    error: ErrorInfo | None = None
    # From the prefill worker: the decode worker the request continues on (its lease's), which
    # the gateway then takes tokens from. A chunk with only this (no tokens) announces a
    # hand-off retried on another decode worker.
    decode_id: InstanceId | None = None
