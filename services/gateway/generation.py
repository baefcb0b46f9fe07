"""The request core: one request admitted and run on the cluster, read as text.

`Generations` admits a request for the served model (its blocks named in its
tenant's cache scope, within its tenant's quotas) and starts it on the workers;
a worker that dies under it moves it (`migration.py`), each attempt being a
`dispatch.RequestRun` watched by a `WorkerWatch`. A `Generation` is one
such request while it runs. Domain errors leave here; nothing here knows HTTP.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from libs.common.peers import PeerDirectory
from libs.common.service import Service
from libs.common.tenants import Tenant
from libs.protocol.hashing import BlockHash, block_hashes, model_extra
from libs.protocol.ids import InstanceId, RequestId
from libs.protocol.slo import SLOOverride
from services.gateway.dispatch import RequestRun
from services.gateway.errors import ModelNotServedError, QuotaExceededError, RateLimitedError, ServiceUnavailableError
from services.gateway.migration import MigratingRun
from services.gateway.openai_protocol import GenerateRequest
from services.gateway.quotas import Quotas
from services.gateway.response_bodies import Usage
from services.gateway.served_model import PreparedRequest, ServedModel
from services.gateway.settings import GatewaySettings
from services.gateway.tenancy import TenantDirectory
from services.gateway.tenant_usage import TenantUsage
from services.gateway.text_stream import Delta, TextStream, stream_deltas
from services.gateway.worker_watch import LOST_AFTER_HEARTBEATS, WorkerWatch

log = logging.getLogger("kvserve.gateway.generation")
INLINE_HASH_TOKENS = 2048  # longer prompts are hashed off the event loop
SHUTTING_DOWN = "shutting_down"  # the error code of a request refused or ended because the gateway stops
# seconds halted requests get to write their ending: a halted wait for tokens wakes within
# dispatch.RECONNECT_CHECK (0.5 s); a halt that finds one being admitted waits for its answer
HALT_SECONDS = 2.0


@dataclass
class Generation:
    """One admitted request: where it runs (moving when a worker dies) and the
    text it has produced so far."""

    run: MigratingRun
    texts: list[TextStream]  # one per sequence (choice) the request asked for
    slo: SLOOverride | None = None  # the request's own targets, where it set them
    started_at: float = 0.0  # time.monotonic() when it was first admitted ...
    ended_at: float | None = None  # ... and when it was over
    tenant: Tenant | None = None  # who sent it (None: no tenant, as a test may run it)
    ratelimit_headers: dict[str, str] = field(default_factory=dict)  # its tenant's x-ratelimit-* headers

    @property
    def text(self) -> TextStream:
        """The first sequence's text (the only one, unless n > 1)."""
        return self.texts[0]

    def deltas(self) -> AsyncIterator[Delta]:
        return stream_deltas(self.run, self.texts)

    def usage(self) -> Usage:
        """The prompt once, the tokens of every sequence."""
        completion = sum(t.num_completion_tokens for t in self.texts)
        return Usage(self.text.num_prompt_tokens, completion, self.text.num_cached_tokens)

    def served_by(self) -> dict[str, Any]:
        """Which instances served it and how often it moved, for its last chunk or body."""
        return self.run.served_by()


class Generations:
    """Runs requests for ``model`` on the cluster ``service`` reaches, with the
    workers' liveness read from ``peers``; counts the requests in flight."""

    def __init__(self, service: Service, settings: GatewaySettings, peers: PeerDirectory, model: ServedModel) -> None:
        self.service = service
        self.settings = settings
        self.peers = peers
        self.model = model
        self.tenants = TenantDirectory(settings.tenants_file, settings.api_key)  # who may send requests
        self._runs: set[MigratingRun] = set()  # the requests in flight, halted by `drain` when it runs out
        self._idle = asyncio.Event()  # set while none is
        self._idle.set()
        self.draining = False  # `drain` began: no new request is taken
        self.quotas = Quotas()  # each tenant's, checked before admission
        self.observers: list[Callable[[Generation], None]] = []  # told of every admitted request once it is over
        self.usage = TenantUsage(service.metrics)  # what each tenant used, and was refused

    @property
    def num_in_flight(self) -> int:
        return len(self._runs)

    @asynccontextmanager
    async def generate(
        self, request: GenerateRequest, request_id: RequestId, slo: SLOOverride | None = None, session_id: str | None = None,
        tenant: Tenant | None = None,
    ) -> AsyncIterator[Generation]:
        """Admit ``request`` and start it on the cluster; inside the block, read its
        text. A worker that dies under it moves it (at most ``max_attempts`` tries
        in all); leaving the block early (an error, a disconnect) cancels it. Its KV
        blocks are named in ``tenant``'s cache scope (None: the default scope)."""
        model, s = self.model, self.settings
        if request.model != model.model_id:
            raise ModelNotServedError(request.model)
        prepared = await model.prepare(request, request_id, self.tenants.hash_root(tenant, request.cache_salt))
        if self.draining:  # checked after the last wait before it counts as in flight: a drain sees every run
            raise ServiceUnavailableError("the gateway is shutting down; send the request again", SHUTTING_DOWN)
        if tenant is not None and self.tenants.isolated:  # shares under overload are by tenant
            prepared = replace(prepared, tenant=tenant.name, tenant_weight=tenant.weight,
                               cache_owner=self.tenants.tenants.cache_owner(tenant))
        try:
            lease = None if tenant is None else self.quotas.acquire(
                tenant, prepared.num_prompt_tokens, prepared.sampling.max_tokens * prepared.sampling.n)
        except QuotaExceededError as e:
            self.usage.refused(tenant, e.reason or "quota")
            raise
        texts = [TextStream(model.tokenizer, prepared.sampling, model.max_model_len, prepared.num_prompt_tokens)
                 for _ in range(prepared.sampling.n)]  # fmt: skip
        silence = LOST_AFTER_HEARTBEATS * s.heartbeat_interval

        def attempt(p: PreparedRequest, exclude: frozenset[str]) -> RequestRun:
            watch = WorkerWatch(self.peers, silence)
            return RequestRun(self.service, p, s.request_timeout, slo=slo, exclude=exclude, watch=watch,
                              session_id=session_id, moved=p is not prepared)  # fmt: skip

        generation, started_at = None, time.monotonic()
        migrating = MigratingRun(prepared, attempt, self._block_hashes, s.max_attempts, self._started_at,
                                 self.peers.beats, self.peers.silent_for, s.admit_retry_window)  # fmt: skip
        self._runs.add(migrating)
        self._idle.clear()
        try:
            async with migrating as run:
                generation = Generation(run, texts, slo, started_at, tenant=tenant,
                                        ratelimit_headers=lease.headers if lease else {})  # fmt: skip
                yield generation
        except RateLimitedError as e:
            if generation is None:  # the conductor refused it
                self.usage.refused(tenant, e.reason or "rate_limited")
            raise
        finally:
            self._runs.discard(migrating)
            if not self._runs:
                self._idle.set()
            if lease is not None:  # what it did not use goes back (all of it, when it never ran)
                used = 0 if generation is None else texts[0].num_prompt_tokens + sum(t.num_completion_tokens for t in texts)
                self.quotas.release(lease, used)
            if generation is not None:
                generation.ended_at = time.monotonic()
                self.usage.observe(tenant, generation.usage())
                for observe in self.observers:
                    observe(generation)

    async def drain(self, timeout: float) -> None:
        """Take no new request (they get 503 ``shutting_down``); give those in flight
        ``timeout`` seconds to finish, then halt the rest: each ends with a ``shutting_down``
        error (a stream: its error event, an "error" finish and [DONE]) and its workers are
        told to drop it."""
        self.draining = True
        if await self._idle_within(timeout):
            return
        log.warning("%d requests still running after %g s of drain: ending them", len(self._runs), timeout)
        error = ServiceUnavailableError("the gateway shut down before the request finished", SHUTTING_DOWN)
        for run in list(self._runs):
            run.halt(error)
        if not await self._idle_within(HALT_SECONDS):
            log.warning("%d requests did not end within %g s of being halted", self.num_in_flight, HALT_SECONDS)

    async def _idle_within(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _started_at(self, instance_id: InstanceId) -> float | None:
        heard = self.peers.last_heard(instance_id)
        return None if heard is None else heard[0].started_at

    async def _block_hashes(self, token_ids: list[int], root: BlockHash) -> list[BlockHash]:
        """The block hashes of a prompt in the scope of ``root``, as the workers name its KV blocks."""
        model = self.model
        extra = model_extra(model.model_id)
        if len(token_ids) > INLINE_HASH_TOKENS:
            return await asyncio.to_thread(block_hashes, token_ids, model.block_size, extra, root)
        return block_hashes(token_ids, model.block_size, extra, root)
