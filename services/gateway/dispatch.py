"""The NATS side of one request: admission by the conductor, submission to the
chosen prefill worker, and the request's tokens back, in order.

`RequestRun` is one attempt at a request, an async context manager; whichever
way the block is left it unsubscribes from the token subject and, unless the
workers said the request finished, broadcasts a Cancel so no worker keeps
running it. While it waits for tokens it watches the workers serving it (the
prefill worker until the decode worker takes over, then the decode worker) and
raises WorkerLostError as soon as one is gone, instead of waiting out the token
timeout; `migration.py` moves the request on. It takes a token chunk only from an
instance the request is placed on: the admission's prefill worker and its decode
worker, or the one that prefill worker says it continues on (a token subject names
its publisher, and NATS lets an instance publish only under its own name). The conductor
hears of the request's first token and of its end (RequestProgress), to settle
its predictions. Failures are raised as the gateway's domain errors (`upstream_errors.py`);
nothing here knows about HTTP.
"""

import asyncio
import logging
import math
import time

import nats.errors
from nats.aio.msg import Msg

from libs.common.service import Service
from libs.protocol import schema, subjects
from libs.protocol.hashing import ROOT
from libs.protocol.ids import InstanceId
from libs.protocol.schema import (
    Ack,
    AdmitReply,
    AdmitRequest,
    BadMessageError,
    Cancel,
    ErrorReply,
    PrefillRequest,
    RequestProgress,
    ResendRequest,
    TokenChunk,
)
from libs.protocol.slo import SLOOverride
from libs.protocol.vocabulary import Role
from services.gateway.errors import RequestTimeoutError
from services.gateway.reorder import ChunkReorderer
from services.gateway.served_model import PreparedRequest
from services.gateway.upstream_errors import (
    CONDUCTOR,
    FAILED_CODES,
    HANDOFF_LOST_CODES,
    NO_ANSWER,
    WorkerLostError,
    admission_error,
    raise_no_answer,
)
from services.gateway.upstream_errors import worker as upstream_worker
from services.gateway.upstream_errors import worker_error
from services.gateway.worker_watch import WorkerWatch

CONTROL_TIMEOUT = 5.0  # seconds the conductor and a prefill worker have to answer
# An admission unanswered this long is asked again, so it reaches another conductor replica if
# the first died holding it (asking twice is safe: a replica keeps one booking per request).
ADMIT_ATTEMPT_TIMEOUT = 1.5
MIN_WAIT = 0.001  # seconds: a wait on the token subject that is due now still takes what is there
RECONNECT_CHECK = 0.5  # seconds: a silent token subject is checked this often for a NATS reconnect
RESEND_TIMEOUT = 1.0  # seconds a decode worker has to publish a cut stream's tokens again
log = logging.getLogger("kvserve.gateway.dispatch")


class RequestRun:
    def __init__(
        self,
        service: Service,
        prepared: PreparedRequest,
        token_timeout: float,
        control_timeout: float = CONTROL_TIMEOUT,
        slo: SLOOverride | None = None,
        exclude: frozenset[str] = frozenset(),
        watch: WorkerWatch | None = None,
        session_id: str | None = None,
        moved: bool = False,
    ) -> None:
        self.service = service
        self.prepared = prepared
        self.request_id = prepared.request_id
        self.token_timeout = token_timeout
        self.control_timeout = control_timeout
        self.slo = slo or SLOOverride()
        self.exclude = exclude  # instances the conductor must not choose
        self.watch = watch  # None: only the token timeout notices a dead worker
        self.session_id = session_id  # the conversation it belongs to (the conductor keeps its turns together)
        self.moved = moved  # a later attempt of a request whose worker was lost
        self.prefill_id: str | None = None
        self.decode_id: str | None = None  # the conductor's choice ...
        self.placed_decode_id: str | None = None  # ... or the one its prefill worker named (a hand-off was retried)
        self.serving_decode_id: str | None = None  # ... and the one whose tokens came
        self.admission: AdmitReply | None = None  # what the conductor predicted
        self.ttft_s: float | None = None  # measured from admission to the first token
        self.num_output_tokens = 0  # generated so far (the conductor settles its TBT prediction with it)
        self._admitted_at: float | None = None
        self._asked_at = 0.0  # when the admission was asked for: the TTFT target counts from there
        self._reorders = [ChunkReorderer() for _ in range(prepared.sampling.n)]  # one per choice
        self._sub = None
        self._may_be_running = False  # some service may hold the request: cancel it on the way out
        self.cancelled = False  # a Cancel went out under its id: no attempt may use that id again
        self._failure: str | None = None  # why the token stream failed, for the Cancel
        self._reconnects = 0  # the service's NATS reconnects when the token subject was subscribed
        self._halt: Exception | None = None  # set by `halt`: what the next wait for tokens raises

    @property
    def finished(self) -> bool:
        """The workers said the request is done (every one of its sequences)."""
        return all(reorder.finished for reorder in self._reorders)

    async def __aenter__(self) -> "RequestRun":
        try:
            await self._admit()
            # Subscribe before any work is sent, so not even the first token can be missed.
            self._sub = await self.service.nc.subscribe(subjects.request_tokens(self.request_id))
            self._reconnects = getattr(self.service, "reconnects", 0)
            await self._submit()
        except BaseException as e:
            await self.close(_reason(e))
            raise
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.close(self._failure or _reason(exc) or "error")

    # --- the way in -------------------------------------------------------------
    async def _admit(self) -> None:
        p = self.prepared
        admit = AdmitRequest(
            request_id=self.request_id,
            num_prompt_tokens=p.num_prompt_tokens,
            max_tokens=p.sampling.max_tokens,
            block_hashes=list(p.block_hashes),
            slo_ttft_s=self.slo.ttft_s,
            slo_tbt_s=self.slo.tbt_s,
            exclude=sorted(self.exclude),
            session_id=self.session_id,
            best_effort=self.slo.best_effort,
            moved=self.moved,
            tenant=p.tenant,
            tenant_weight=p.tenant_weight,
            num_sequences=p.sampling.n,
        )
        asked_at = time.monotonic()
        self._may_be_running = True  # from here on the conductor may have admitted it
        try:
            reply = await self._ask_conductor(admit)
        except NO_ANSWER as e:
            if isinstance(e, nats.errors.NoRespondersError):
                self._may_be_running = False  # no conductor heard of it
            raise_no_answer(e, CONDUCTOR, self.control_timeout)
        if isinstance(reply, ErrorReply):
            if reply.code not in FAILED_CODES:  # it said no: it holds nothing of the request
                self._may_be_running = False
            raise admission_error(reply)
        self.prefill_id, self.decode_id = reply.prefill_id, reply.decode_id
        self.placed_decode_id = reply.decode_id
        self.admission, self._admitted_at, self._asked_at = reply, time.monotonic(), asked_at
        if self.watch is not None:
            self.watch.watch(self.decode_id, Role.DECODE)
            self.watch.watch(self.prefill_id, Role.DECODE if reply.prefill_on_decode else Role.PREFILL)

    async def _ask_conductor(self, admit: AdmitRequest) -> AdmitReply | ErrorReply:
        """The admission's answer from any conductor replica within the control timeout,
        split into attempts of at most ADMIT_ATTEMPT_TIMEOUT: the queue group hands each
        attempt to a live replica, so one that died holding the request costs one attempt."""
        attempts = max(1, math.ceil(self.control_timeout / ADMIT_ATTEMPT_TIMEOUT))
        timeout = self.control_timeout / attempts
        for _ in range(attempts - 1):
            try:
                return await self.service.request(subjects.CONDUCTOR_ADMIT, admit, AdmitReply, timeout)
            except nats.errors.TimeoutError:
                log.warning("no conductor answered admission %s within %.2gs: asking again", self.request_id, timeout)
        return await self.service.request(subjects.CONDUCTOR_ADMIT, admit, AdmitReply, timeout)

    async def _submit(self) -> None:
        p = self.prepared
        target = self.admission.prefill_deadline_s if self.admission is not None else None
        request = PrefillRequest(
            request_id=self.request_id,
            prompt_token_ids=p.prompt_token_ids,
            sampling=p.sampling,
            decode_id=self.decode_id,
            num_prior_output_tokens=p.num_prior_output_tokens,
            ttft_budget_s=None if target is None else max(0.0, target - (time.monotonic() - self._asked_at)),
            hash_root=None if p.hash_root == ROOT else p.hash_root,
            favored=self.admission is not None and self.admission.favored,
            cache_owner=p.cache_owner,
        )
        subject, role = subjects.prefill_submit(self.prefill_id), Role.PREFILL
        if self.admission is not None and self.admission.prefill_on_decode:  # conditional disaggregation
            subject, role = subjects.decode_prefill(self.decode_id), Role.DECODE
        worker = upstream_worker(self.prefill_id, role, self._started_at(self.prefill_id))
        try:
            ack = await self.service.request(subject, request, Ack, self.control_timeout)
        except NO_ANSWER as e:
            raise_no_answer(e, worker, self.control_timeout)
        if isinstance(ack, ErrorReply):
            raise worker_error(ack, worker.where)

    # --- the tokens -------------------------------------------------------------
    async def next_chunks(self) -> list[TokenChunk]:
        """Wait for the next message on the token subject; return the chunks now in
        order (often one, possibly none). Raises when a worker fails, when a worker
        serving the request is gone, or when nothing arrives for ``token_timeout`` seconds."""
        assert self._sub is not None, "next_chunks outside `async with`"
        msg = await self._next_message()
        publisher = subjects.token_publisher(msg.subject)
        if publisher not in (self.prefill_id, self.placed_decode_id):
            log.warning("dropped a token chunk for %s from %s: it is placed on %s and %s",
                        self.request_id, publisher, self.prefill_id, self.placed_decode_id)  # fmt: skip
            return []
        try:
            chunk = schema.decode(msg.data, TokenChunk)
        except BadMessageError as e:
            log.warning("dropped a message on %s: %s", msg.subject, e)
            return []
        if chunk.decode_id is not None and publisher == self.prefill_id and chunk.decode_id != self.placed_decode_id:
            log.info("%s continues on %s", self.request_id, chunk.decode_id)
            if self.watch is not None and self.placed_decode_id != self.prefill_id:
                self.watch.unwatch(self.placed_decode_id)
                self.watch.watch(chunk.decode_id, Role.DECODE)
            self.placed_decode_id = chunk.decode_id  # the prefill worker leased there: its tokens are ours
        if not chunk.token_ids and chunk.finish_reason is None and chunk.error is None:
            return []  # it only said where the request continues
        if chunk.error is not None:
            self._failure = f"error: {chunk.error.code}"
            where = f"instance {chunk.instance_id}" if chunk.instance_id else "a worker"
            if chunk.error.code in HANDOFF_LOST_CODES:  # no decode worker took the KV: admit it again,
                # passing over the chosen one until it is heard from again (a dead one: until its restart)
                raise WorkerLostError(f"{where} failed: {chunk.error.message}", self.decode_id, Role.DECODE,
                                      self._started_at(self.decode_id), until_heard=True)  # fmt: skip
            raise worker_error(chunk.error, where)
        if not 0 <= chunk.choice < len(self._reorders):
            log.warning("dropped a chunk of %s for choice %d of %d", self.request_id, chunk.choice, len(self._reorders))
            return []
        if chunk.index == 0 and self.ttft_s is None and self._admitted_at is not None:
            self.ttft_s = time.monotonic() - self._admitted_at
            await self._progress(RequestProgress(request_id=self.request_id, kind="first_token", ttft_s=self.ttft_s))
        reorder = self._reorders[chunk.choice]
        before = reorder.next_index
        ready = reorder.push(chunk)
        self.num_output_tokens += reorder.next_index - before
        if chunk.index > 0 and self.serving_decode_id is None:
            self._decoding_on(publisher)
        return ready

    async def _next_message(self) -> Msg:
        """The next message on the token subject. Wakes up when a watched worker
        would count as gone unless heard from since, not only at the token timeout."""
        deadline = time.monotonic() + self.token_timeout
        while True:
            if self._halt is not None:
                self._failure = "halted"
                raise self._halt
            wait = min(deadline - time.monotonic(), self.watch.seconds_to_next_check() if self.watch else math.inf)
            try:
                return await self._sub.next_msg(timeout=max(min(wait, RECONNECT_CHECK), MIN_WAIT))
            except nats.errors.TimeoutError:
                pass
            reconnects = getattr(self.service, "reconnects", 0)
            if reconnects != self._reconnects:
                # NATS came back after an outage: tokens published meanwhile are lost, and
                # this silence says the stream is stuck behind them. Its decode worker sends
                # them again if it still has them; else the stream continues elsewhere.
                if await self._ask_resend():
                    self._reconnects = reconnects
                    continue
                self._failure = "NATS reconnected"
                raise WorkerLostError("the stream was cut by a NATS outage", None, "nats")
            gone = self.watch.gone() if self.watch is not None else None
            if gone is not None:
                self._failure = f"{gone.instance_id} is gone"
                where = f"{gone.role} instance {gone.instance_id}"
                # silent: it serves again once heard from (a stalled process, not a dead one)
                raise WorkerLostError(f"{where} is gone ({gone.why})", gone.instance_id, gone.role, gone.started_at,
                                      until_heard=not gone.restarted)  # fmt: skip
            if time.monotonic() >= deadline:
                self._failure = "timeout"
                raise RequestTimeoutError(f"no token arrived for {self.token_timeout:g} seconds")

    async def _ask_resend(self) -> bool:
        """Ask the decode worker the request is on to publish its tokens again from the first
        one not delivered; False if it cannot (not there yet, gone, or no longer has them)."""
        decode_id = self.serving_decode_id or self.placed_decode_id or self.decode_id
        if decode_id is None or len(self._reorders) != 1:  # n > 1: its choices are not sent again
            return False
        ask = ResendRequest(request_id=self.request_id, from_index=self._reorders[0].next_index)
        try:
            reply = await self.service.request(subjects.decode_resend(decode_id), ask, Ack, timeout=RESEND_TIMEOUT)
        except (nats.errors.Error, BadMessageError, TimeoutError) as e:
            log.info("%s: %s could not send its tokens again (%s)", self.request_id, decode_id, e)
            return False
        if not isinstance(reply, Ack):
            log.info("%s: %s could not send its tokens again (%s)", self.request_id, decode_id, reply.message)
            return False
        log.info("%s: a NATS outage cut its stream; %s sends it again from token %d", self.request_id, decode_id,
                 ask.from_index)  # fmt: skip
        return True

    def _started_at(self, instance_id: InstanceId | None) -> float | None:
        """The start time of the process admission chose under ``instance_id``, as watched."""
        return self.watch.started_at(instance_id) if self.watch is not None and instance_id else None

    def _decoding_on(self, instance_id: InstanceId) -> None:
        """The decode worker's first token came: the prefill worker's part is done."""
        self.serving_decode_id = instance_id
        if self.watch is None:
            return
        for watched in self.watch.watched:
            if watched != instance_id:
                self.watch.unwatch(watched)
        self.watch.watch(instance_id, Role.DECODE)

    # --- the way out ------------------------------------------------------------
    def halt(self, error: Exception) -> None:
        """Make the wait for tokens raise ``error`` (the gateway is stopping): at once when
        one comes, else within RECONNECT_CHECK seconds. Leaving the run then cancels it."""
        self._halt = error

    async def cancel(self, reason: str) -> None:
        """Tell every service to drop the request; at most once, never after it finished."""
        if not self._may_be_running or self.finished:
            return
        self._may_be_running = False
        self.cancelled = True
        log.info("cancelling %s: %s", self.request_id, reason)
        try:
            await self.service.publish(subjects.CANCEL, Cancel(request_id=self.request_id, reason=reason))
        except Exception as e:  # NATS gone: the workers' own timeouts are the last line
            log.warning("cancel of %s not sent: %s", self.request_id, e)

    async def close(self, reason: str) -> None:
        await self.cancel(reason)
        if self._admitted_at is not None:
            self._admitted_at = None
            await self._progress(RequestProgress(request_id=self.request_id, kind="finished",
                                                 num_output_tokens=self.num_output_tokens))  # fmt: skip
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as e:
                log.warning("unsubscribe from %s failed: %s", subjects.request_tokens(self.request_id), e)


    async def _progress(self, progress: RequestProgress) -> None:
        try:
            await self.service.publish(subjects.CONDUCTOR_PROGRESS, progress)
        except Exception as e:  # the conductor's predictions drift a little; the request goes on
            log.warning("progress of %s not sent: %s", self.request_id, e)


def _reason(exc: BaseException | None) -> str | None:
    """The Cancel reason for leaving a run with ``exc``."""
    if exc is None:
        return None
    if isinstance(exc, (asyncio.CancelledError, ConnectionResetError)):
        return "client disconnected"
    if isinstance(exc, RequestTimeoutError):
        return "timeout"
    return "error"
