"""How a control request that gets no valid answer, or a refusal, becomes the
gateway's domain error: the conductor's silence is a 503 no_conductor, a worker's
absence or silence a WorkerLostError (so the request can move), NATS failing
otherwise a 503, a reply that is no valid message an upstream error, and the
conductor's refusals and a worker's error replies their own errors. Knows nothing
of HTTP.
"""

from dataclasses import dataclass
from typing import NoReturn

import nats.errors

from libs.protocol.ids import InstanceId
from libs.protocol.schema import BadMessageError, ErrorInfo, ErrorReply
from libs.protocol.vocabulary import ErrorCode, Role
from services.gateway.errors import (
    InvalidParameterError,
    RateLimitedError,
    ServiceUnavailableError,
    UpstreamError,
)

_MISSING_ROLE_CODES = (ErrorCode.NO_PREFILL, ErrorCode.NO_DECODE, ErrorCode.NO_INSTANCES)
# A prefill worker's hand-off found no decode worker answering (one died, or NATS was
# down a moment), one that no longer holds the lease (restarted under its id), or the
# leased one's process gone while its KV was on the way (peer_gone): the request is
# worth another admission, which sees the cluster anew.
HANDOFF_LOST_CODES = (ErrorCode.DECODE_UNAVAILABLE, ErrorCode.NO_DECODE, ErrorCode.NO_LEASE, ErrorCode.PEER_GONE)
# The answerer failed (its handler raised, or it could not read the request) rather than said no.
FAILED_CODES = (ErrorCode.INTERNAL, ErrorCode.BAD_MESSAGE)


class WorkerLostError(ServiceUnavailableError):
    """A worker serving the request is gone (silent, restarted, or not taking requests).
    ``started_at``: the start time of the process seen gone, where known (a process
    restarted under the same id since is another, and may serve the request again).
    ``until_heard``: only suspected gone (silent for a while, or a hand-off found it not
    answering): it serves again once heard from, as a live worker is within a heartbeat."""

    def __init__(self, message: str, instance_id: InstanceId | None, role: str,  # None: the control plane
                 started_at: float | None = None, until_heard: bool = False) -> None:  # fmt: skip
        super().__init__(message, "worker_lost")
        self.instance_id = instance_id
        self.role = role
        self.started_at = started_at
        self.until_heard = until_heard


def admission_error(error: ErrorReply) -> Exception:
    if error.code == ErrorCode.REJECTED:
        details = {"retry_after_s": error.retry_after_s, "predicted_ttft_s": error.predicted_ttft_s,
                   "predicted_tbt_s": error.predicted_tbt_s}  # fmt: skip
        details = {k: v for k, v in details.items() if v is not None}
        return RateLimitedError(error.message, error.retry_after_s, details, error.reason)
    if error.code in _MISSING_ROLE_CODES:
        return ServiceUnavailableError(error.message, error.code)
    if error.code in FAILED_CODES:
        return UpstreamError(CONDUCTOR.say(CONDUCTOR.failed, 0.0, error.message))
    return ServiceUnavailableError(f"the conductor cannot admit the request: {error.message}", error.code)


def worker_error(error: ErrorInfo | ErrorReply, where: str) -> Exception:
    if error.code == ErrorCode.NO_CAPACITY:
        return ServiceUnavailableError(f"{where} has no capacity: {error.message}", error.code)
    if error.code == ErrorCode.INVALID_REQUEST:
        return InvalidParameterError(error.message)
    return UpstreamError(f"{where} failed: {error.message}", error.code)


# How a control request can get no valid answer: NATS's errors (no responders and
# timeouts among them) and a reply that is no valid message.
NO_ANSWER = (nats.errors.Error, BadMessageError)


@dataclass(frozen=True)
class Answerer:
    """Who answers a control request, in the words its errors use. A worker's
    absence or silence is a WorkerLostError, so the request can move; the
    conductor's is a ServiceUnavailableError. Each phrase is a `str.format`
    template with ``where``, ``timeout`` and ``error``."""

    where: str
    gone: str  # no one subscribes to the subject
    silent: str  # no answer within the timeout
    unreachable: str  # NATS failed otherwise
    failed: str  # the reply is no valid message
    code: ErrorCode  # the ServiceUnavailableError code when NATS failed
    instance_id: InstanceId | None = None  # a worker: its id, its role and its process's start time below
    role: str = ""
    started_at: float | None = None

    def say(self, phrase: str, timeout: float, error: Exception) -> str:
        return phrase.format(where=self.where, timeout=timeout, error=error)


CONDUCTOR = Answerer(
    where="the conductor",
    gone="conductor unavailable: no conductor is running",
    silent="conductor unavailable: no answer within {timeout:g}s",
    unreachable="conductor unavailable: {error}",
    failed="the conductor failed to admit the request: {error}",
    code=ErrorCode.NO_CONDUCTOR,
)


def worker(instance_id: InstanceId, role: str, started_at: float | None = None) -> Answerer:
    return Answerer(
        where=f"{role} instance {instance_id}",
        gone="{where} is unavailable",  # its process is gone; the conductor has not noticed yet
        silent="{where} did not answer within {timeout:g}s",
        unreachable="{where} is unreachable: {error}",
        failed="{where} failed: {error}",
        code=ErrorCode.NO_DECODE if role == Role.DECODE else ErrorCode.NO_PREFILL,
        instance_id=instance_id,
        role=role,
        started_at=started_at,
    )


def raise_no_answer(error: Exception, who: Answerer, timeout: float) -> NoReturn:
    """Raise the domain error for a control request to ``who`` that failed with ``error``
    (one of NO_ANSWER); called in the ``except`` clause that caught it."""
    if isinstance(error, BadMessageError):
        raise UpstreamError(who.say(who.failed, timeout, error)) from error
    if isinstance(error, (nats.errors.NoRespondersError, nats.errors.TimeoutError)):
        phrase = who.gone if isinstance(error, nats.errors.NoRespondersError) else who.silent
        message = who.say(phrase, timeout, error)
        if who.instance_id is None:
            raise ServiceUnavailableError(message, who.code) from None
        raise WorkerLostError(message, who.instance_id, who.role, who.started_at) from None
    raise ServiceUnavailableError(who.say(who.unreachable, timeout, error), who.code) from error
