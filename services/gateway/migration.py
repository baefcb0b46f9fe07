"""One request over as many attempts as its workers' deaths take.

Each attempt is a `dispatch.RequestRun` with its own request id. When a worker
serving an attempt is gone (WorkerLostError), the attempt is cancelled
everywhere (its blocks on the survivors are freed) and the request is admitted
again as ``<id>-m<n>``, excluding every instance seen gone (a dead one until it restarts, one
only silent until it is heard again), with the tokens
already delivered appended to its prompt, max_tokens and min_tokens reduced by
them and their number carried (``num_prior_output_tokens``: the workers' penalties
count them as generated, and seeded draws go on from them): the new prefill,
mostly a prefix-cache hit, yields the next token and decoding goes on.
The caller reads one stream whose chunk indexes carry on where the last attempt
left off, so greedy output equals an undisturbed run where the engine's numerics do not
depend on the batch (float32; see the README for bfloat16). A request for n > 1
sequences moves only until its first token: after that its loss is raised. After ``max_attempts``
the loss is raised. Knows nothing of HTTP or text.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import msgspec

from libs.protocol.hashing import BlockHash
from libs.protocol.ids import InstanceId
from libs.protocol.schema import AdmitReply, TokenChunk
from libs.protocol.vocabulary import ErrorCode
from services.gateway.dispatch import RequestRun
from services.gateway.errors import ServiceUnavailableError
from services.gateway.served_model import PreparedRequest
from services.gateway.settings import ADMIT_RETRY_WINDOW
from services.gateway.upstream_errors import WorkerLostError

# (the request for this attempt, instances to exclude) -> an attempt not yet entered
AttemptFactory = Callable[[PreparedRequest, frozenset[str]], RequestRun]
BlockHasher = Callable[[list[int], BlockHash], Awaitable[list[BlockHash]]]  # a prompt's, from a root

_WAIT_FOR_ROLES = {ErrorCode.NO_CONDUCTOR: ("conductor",), ErrorCode.NO_PREFILL: ("prefill",),
                   ErrorCode.NO_DECODE: ("decode",), ErrorCode.NO_INSTANCES: ("prefill", "decode")}  # fmt: skip
ADMIT_RETRY_DELAY = 0.2

log = logging.getLogger("kvserve.gateway.migration")


class MigratingRun:
    def __init__(
        self,
        prepared: PreparedRequest,
        new_attempt: AttemptFactory,
        block_hashes: BlockHasher,
        max_attempts: int,
        started_at: Callable[[str], float | None] = lambda instance_id: None,
        beats_heard: Callable[[str], int] = lambda instance_id: 0,
        silent_for: Callable[[str], float | None] = lambda role: None,
        retry_window: float = ADMIT_RETRY_WINDOW,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"a request needs at least one attempt, got {max_attempts}")
        self.retry_window = retry_window
        self.prepared = prepared
        self.request_id = prepared.request_id
        self.max_attempts = max_attempts
        self.migrations = 0  # attempts started because a worker was gone
        self.ttft_s: float | None = None  # from the first admission to the first token, across attempts
        self._new_attempt = new_attempt
        self._block_hashes = block_hashes
        self._attempt: RequestRun | None = None
        self._served: list[RequestRun] = []  # every attempt that reached a worker, in order
        self._num_attempts = 0
        self._renamed = 0  # attempts asked again under a new id, their old one cancelled (`_attempt_request`)
        # instance id -> (the start time of the process seen gone, how many of its heartbeats were
        # heard then where hearing it again is enough to serve again: see WorkerLostError.until_heard)
        self._gone: dict[str, tuple[float | None, int | None]] = {}
        self._process_start = started_at  # an instance's current process's start time, from its heartbeats
        self._beats_heard = beats_heard  # how many heartbeats of an instance were heard
        self._silent_for = silent_for  # seconds since any instance of a role was heard; None: never
        self._delivered: list[int] = []  # generated tokens handed to the caller, over every attempt
        self._streamed = False  # n > 1: some sequence's tokens were handed to the caller
        self._offset = 0  # tokens delivered before the current attempt started
        self._started_at = 0.0
        self.taken_at: float | None = None  # time.monotonic() when a worker first took it (admitted and submitted)
        self.delivery_times: list[float] = []  # time.monotonic() of each delivery of generated tokens, in order
        self._halt: Exception | None = None  # set by `halt`: no attempt starts, the current one raises it

    # --- what the headers and the final chunk say ------------------------------------
    @property
    def prefill_id(self) -> str | None:
        return self._attempt.prefill_id if self._attempt is not None else None

    @property
    def decode_id(self) -> str | None:
        return self._attempt.decode_id if self._attempt is not None else None

    @property
    def admission(self) -> AdmitReply | None:
        return self._attempt.admission if self._attempt is not None else None

    @property
    def finished(self) -> bool:
        return self._attempt is not None and self._attempt.finished

    def served_by(self) -> dict[str, Any]:
        """The instances that worked on the request, in order, and how often it moved."""
        prefills: list[str] = []
        decodes: list[str] = []
        for run in self._served:
            for ids, instance in ((prefills, run.prefill_id), (decodes, run.serving_decode_id or run.decode_id)):
                if instance and instance not in ids:
                    ids.append(instance)
        return {"prefill_instances": prefills, "decode_instances": decodes, "migrations": self.migrations}

    # --- the way in and out -------------------------------------------------------------
    async def __aenter__(self) -> "MigratingRun":
        self._started_at = time.monotonic()
        await self._start_attempt()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        attempt, self._attempt = self._attempt, None
        if attempt is not None:
            await attempt.__aexit__(exc_type, exc, tb)

    async def cancel(self, reason: str) -> None:
        if self._attempt is not None:
            await self._attempt.cancel(reason)

    def halt(self, error: Exception) -> None:
        """End the request with ``error`` (the gateway is stopping): the attempt running raises
        it from its wait for tokens, and no attempt starts after it."""
        self._halt = error
        if self._attempt is not None:
            self._attempt.halt(error)

    # --- the tokens -----------------------------------------------------------------------
    async def next_chunks(self) -> list[TokenChunk]:
        """The next in-order chunks, indexed from the request's first generated token."""
        while True:
            try:
                chunks = await self._attempt.next_chunks()
                break
            except WorkerLostError as e:
                lost, self._attempt = self._attempt, None
                why = f"{e.instance_id} is gone" if e.instance_id else "NATS cut the stream"
                await lost.close(f"moved elsewhere: {why}")
                self._lost(e)
                await self._start_attempt()
        if chunks and self.ttft_s is None:
            self.ttft_s = self._served[0].ttft_s if self.migrations == 0 else time.monotonic() - self._started_at
        if any(chunk.token_ids for chunk in chunks):
            self.delivery_times.append(time.monotonic())
        return [self._continued(chunk) for chunk in chunks]

    def _continued(self, chunk: TokenChunk) -> TokenChunk:
        if self.prepared.sampling.n > 1:  # not moved once it has streamed (`_lost`)
            self._streamed = self._streamed or bool(chunk.token_ids)
            return chunk
        self._delivered.extend(chunk.token_ids)
        if self._offset == 0:
            return chunk
        return msgspec.structs.replace(chunk, index=chunk.index + self._offset)

    # --- attempts -------------------------------------------------------------------------
    async def _start_attempt(self) -> None:
        """Admit and submit the next attempt; move on again if its worker is already gone.
        An attempt that finds no conductor answering (NATS just came back, or it is being
        restarted) or no worker of a role it needs asks again for up to ``retry_window`` seconds:
        a later attempt always, the first one while that role was heard from lately."""
        retry_until = time.monotonic() + self.retry_window
        while True:
            if self._halt is not None:
                raise self._halt
            self._num_attempts += 1
            run = self._new_attempt(await self._attempt_request(), self._excluded())
            try:
                await run.__aenter__()  # closes the attempt itself when it fails
            except WorkerLostError as e:
                self._lost(e)
                continue
            except ServiceUnavailableError as e:
                if not self._may_wait_for(e.code) or time.monotonic() >= retry_until:
                    raise
                self._num_attempts -= 1  # not a worker lost: the same attempt, asked again
                if run.cancelled:  # its id was cancelled on every worker, which would drop it: a new one
                    self._renamed += 1
                await asyncio.sleep(ADMIT_RETRY_DELAY)  # a bounded wait for the conductor to come back
                continue
            self._attempt, self._offset = run, len(self._delivered)
            if self._halt is not None:  # halted while this attempt was being admitted
                run.halt(self._halt)
            self._served.append(run)
            if self.taken_at is None:
                self.taken_at = time.monotonic()
            return

    def _may_wait_for(self, code: str) -> bool:
        """Whether an admission refused for ``code`` is worth asking again: a role is missing
        that may come (back) soon."""
        roles = _WAIT_FOR_ROLES.get(code)
        if roles is None:
            return False
        if self._num_attempts > 1:  # moved: it has no better place to go
            return True
        silences = [self._silent_for(role) for role in roles]
        return any(s is not None and s < self.retry_window for s in silences)

    def _excluded(self) -> frozenset[str]:
        """The gone instances not restarted since: a process that came back under the same
        id (a supervisor restarted it) serves again, and so does one only suspected gone
        once it has been heard from since."""
        return frozenset(i for i, (started, heard) in self._gone.items() if self._still_gone(i, started, heard))

    def _still_gone(self, instance_id: InstanceId, started: float | None, beats: int | None) -> bool:
        if started is None:
            return True
        if self._process_start(instance_id) != started:
            return False
        return beats is None or self._beats_heard(instance_id) == beats

    def _lost(self, error: WorkerLostError) -> None:
        """Note the gone instance; raise when no attempt is left."""
        if (i := error.instance_id) is not None:  # None: a NATS outage cut the stream, every worker may still serve
            started = error.started_at if error.started_at is not None else self._process_start(i)
            self._gone[i] = (started, self._beats_heard(i) if error.until_heard else None)
        if self._streamed:  # n > 1: its sequences went their own ways, and are not moved
            log.warning("%s: %s; a request for %d sequences is not moved", self.request_id, error,
                        self.prepared.sampling.n)  # fmt: skip
            raise WorkerLostError(f"{error}; a request for several sequences is not moved", error.instance_id,
                                  error.role) from error  # fmt: skip
        if self._num_attempts >= self.max_attempts:
            log.warning("%s: %s; no attempt left (%d made)", self.request_id, error, self._num_attempts)
            message = f"{error}; the request was given up after {self._num_attempts} attempts"
            raise WorkerLostError(message, error.instance_id, error.role) from error
        self.migrations += 1
        log.warning("%s: %s; moving it with %d tokens generated (attempt %d of %d)", self.request_id, error,
                    len(self._delivered), self._num_attempts + 1, self.max_attempts)  # fmt: skip

    async def _attempt_request(self) -> PreparedRequest:
        """The first attempt runs the request as it came; a later one continues it: the
        tokens delivered so far join the prompt and come off max_tokens. Each has an id of
        its own (``<id>-m<n>``), and so has an attempt asked again after its admission went
        unanswered: the gateway then cancelled that id everywhere (a conductor may have
        admitted it), and a worker drops a request whose id it has seen cancelled."""
        p = self.prepared
        number = self._num_attempts - 1 + self._renamed
        if number == 0:
            return p
        request_id = f"{p.request_id}-m{number}"
        if not self._delivered:
            return replace(p, request_id=request_id)
        done = len(self._delivered)
        prompt = p.prompt_token_ids + self._delivered
        sampling = msgspec.structs.replace(p.sampling, max_tokens=p.sampling.max_tokens - done,
                                           min_tokens=max(0, p.sampling.min_tokens - done))  # fmt: skip
        hashes = await self._block_hashes(prompt, p.hash_root)
        return replace(p, request_id=request_id, prompt_token_ids=prompt, sampling=sampling, block_hashes=hashes,
                       num_prior_output_tokens=done)  # fmt: skip
