"""The conductor service: keeps the cluster view from heartbeats and the global
KV index from KV events (at start, from the KV history: `catch_up.py`), answers
admission requests with a (prefill, decode) pair or an early rejection, and settles
its predictions from the gateways' progress reports. Replicas run active-active:
each books its peers' admissions (`replicas.py`). Every decision is `scheduler.py`'s; this is the NATS side.
"""

import asyncio
from contextlib import AsyncExitStack

from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from libs.common import failpoints
from libs.common.kv_events import KVEventTracker
from libs.common.recent import RecentIds
from libs.common.service import Service
from libs.protocol import subjects
from libs.protocol.ids import InstanceId
from libs.protocol.schema import (
    AdmitReply,
    AdmitRequest,
    BadMessageError,
    ConductorAdmission,
    ConductorBeat,
    ConductorViewReply,
    ConductorViewRequest,
    ErrorReply,
    Heartbeat,
    KVEventBatch,
    KVSnapshotReply,
    KVSnapshotRequest,
    LearnedView,
    RequestProgress,
)
from libs.protocol.vocabulary import Role
from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from services.conductor.catch_up import CatchUp
from services.conductor.cluster import ClusterView, Instance
from services.conductor.conductor_metrics import ConductorMetrics
from services.conductor.explain import DecisionLog
from services.conductor.index import KVIndex
from services.conductor.replicas import Replicas
from services.conductor.settings import ConductorSettings

SNAPSHOT_TIMEOUT = 5.0
ADMITTED_MAX_AGE = 900.0  # seconds after which a request never reported finished is forgotten


class Conductor(Service):
    settings: ConductorSettings

    def __init__(self, settings: ConductorSettings) -> None:
        super().__init__(settings)
        self.view = ClusterView(timeout=settings.instance_timeout, block_size=settings.block_size)
        self.index = KVIndex()
        self._unadmitted = RecentIds()  # requests told "cannot admit": their retries are logged at debug
        self.tracker = KVEventTracker(apply=self.index.apply_event, reset=self.index.replace)
        self.view.on_gone = self._forget
        self.heard_views.append(self.view)
        self.scheduler = Admitter(build_policy(settings.policy), self.view, self.index, settings.scheduler_config())
        self.decisions = DecisionLog(self.scheduler.policy.name)  # for the console
        self.scheduler.explain = self.decisions.record
        self._snapshots: set[str] = set()  # instances whose snapshot is being fetched
        self.replicas = Replicas(self.instance_id, self.scheduler)  # active-active: peers' admissions booked here
        self.conductor_metrics = ConductorMetrics(self.metrics, self.scheduler, self.index, self.tracker)
        self.catch_up = CatchUp(self.tracker, self._fetch_snapshot, is_alive=lambda i: self.view.get(i) is not None,
                                settle_s=3 * settings.instance_timeout)  # fmt: skip

    async def start(self, stack: AsyncExitStack) -> None:
        c = self.settings
        self.log.info("policy %s; SLO TTFT %.0f ms, TBT %.0f ms", c.policy, c.slo_ttft_s * 1e3, c.slo_tbt_s * 1e3)
        await self.subscribe_heartbeats(None, self.on_heartbeat)
        await self.subscribe(subjects.KV_EVENTS_ALL, KVEventBatch, self.on_kv_events)
        await self.subscribe(subjects.CONDUCTOR_PROGRESS, RequestProgress, self.on_progress)
        await self.subscribe(subjects.CONDUCTOR_ADMITTED, ConductorAdmission, self.on_peer_admission)
        await self.subscribe(subjects.CONDUCTOR_ADMIT, AdmitRequest, self.on_admit, queue=subjects.CONDUCTOR_QUEUE)
        await self.subscribe(subjects.conductor_view(self.instance_id), ConductorViewRequest, self.on_view)
        expiry = self.spawn(self._expire_loop(), essential=True)
        stack.callback(expiry.cancel)
        history = self.spawn(self.catch_up.run(self.nc))  # the KV history, while the rest goes on
        stack.callback(history.cancel)

    # --- the cluster and its KV ------------------------------------------------------
    async def on_heartbeat(self, heartbeat: Heartbeat, msg: Msg) -> None:
        known = self.view.get(heartbeat.instance_id)
        instance = self.view.observe(heartbeat)
        if heartbeat.cost is not None and (known is None or known.heartbeat.cost != heartbeat.cost):
            self.log.info("%s cost model: %s", heartbeat.instance_id, instance.cost.describe())
        if self.catch_up.catching_up:
            return  # the KV history may hold what its heartbeat says this conductor has not seen
        if self.tracker.on_heartbeat(heartbeat.instance_id, heartbeat.kv_epoch, heartbeat.kv_seq):
            self._fetch_snapshot(heartbeat.instance_id)

    async def on_kv_events(self, batch: KVEventBatch, msg: Msg) -> None:
        self.catch_up.on_batch(batch)

    def _fetch_snapshot(self, instance_id: InstanceId) -> None:
        if instance_id not in self._snapshots:
            self._snapshots.add(instance_id)
            self.spawn(self._snapshot(instance_id))

    async def _snapshot(self, instance_id: InstanceId) -> None:
        try:
            self.log.info("KV events of %s have a gap: fetching its snapshot", instance_id)
            request = KVSnapshotRequest(instance_id=instance_id)
            reply = await self.request(subjects.kv_snapshot(instance_id), request, KVSnapshotReply, SNAPSHOT_TIMEOUT)
        except (NatsError, BadMessageError, asyncio.TimeoutError) as e:
            self._no_snapshot(instance_id, str(e) or type(e).__name__)
            return
        finally:
            self._snapshots.discard(instance_id)
        if isinstance(reply, ErrorReply):
            self._no_snapshot(instance_id, reply.message)
        elif self.tracker.on_snapshot(reply):
            self._fetch_snapshot(instance_id)

    def _no_snapshot(self, instance_id: InstanceId, why: str) -> None:
        self.log.warning("no KV snapshot from %s: %s", instance_id, why)
        self.tracker.snapshot_failed(instance_id)

    def _forget(self, instance: Instance) -> None:
        self.log.warning("%s missed its heartbeats: removed from the cluster view", instance.instance_id)
        self.tracker.forget(instance.instance_id)

    # --- requests ---------------------------------------------------------------------
    async def on_admit(self, request: AdmitRequest, msg: Msg) -> AdmitReply | ErrorReply:
        if failpoints.active("conductor.stall_admit"):
            self.log.warning("failpoint conductor.stall_admit: holding %s unanswered", request.request_id)
            await asyncio.Event().wait()
        d = self.conductor_metrics.timed(lambda: self.scheduler.admit(request))
        if not d.admitted:
            if d.error_code == "rejected":
                self.log.info("rejected %s: %s", request.request_id, d.error_message)
            elif request.request_id in self._unadmitted:  # asked again while it waits for a role to come back
                self.log.debug("cannot admit %s: %s", request.request_id, d.error_message)
            else:
                self._unadmitted.add(request.request_id)
                self.log.warning("cannot admit %s: %s", request.request_id, d.error_message)
            return ErrorReply(
                code=d.error_code, message=d.error_message, retry_after_s=d.retry_after_s, reason=d.reason,
                predicted_ttft_s=d.predicted_ttft_s, predicted_tbt_s=d.predicted_tbt_s,
            )  # fmt: skip
        if (shared := self.replicas.shared(request.request_id)) is not None:
            await self.publish(subjects.CONDUCTOR_ADMITTED, shared)  # before the reply: peers book it first
        if d.affinity is not None:
            self.log.debug("%s of session %s: %s", request.request_id, request.session_id, d.affinity)
        return AdmitReply(
            prefill_id=d.prefill_id, decode_id=d.decode_id, prefill_on_decode=d.prefill_on_decode,
            predicted_ttft_s=d.predicted_ttft_s, predicted_tbt_s=d.predicted_tbt_s, cached_tokens=d.cached_tokens,
            prefill_deadline_s=d.prefill_deadline_s, favored=d.favored,
        )  # fmt: skip

    async def on_view(self, request: ConductorViewRequest, msg: Msg) -> ConductorViewReply:
        """The console's question: the KV map, the hottest prefixes and the last decisions."""
        slo, margins = self.scheduler.config.slo, self.scheduler.margins
        view = self.decisions.view(self.instance_id, self.index, slo, request.max_decisions, request.max_prefixes)
        speeds = {i.instance_id: i.heartbeat.prefill_speed for i in self.view.alive(Role.PREFILL)}
        view.learned = LearnedView(ttft_slack_s=margins.slack_by_band(), tbt_margins=margins.tbt_by_instance(),
                                   prefill_speeds=speeds)  # fmt: skip
        return view

    async def on_peer_admission(self, message: ConductorAdmission, msg: Msg) -> None:
        if self.replicas.on_peer_admission(message):
            self.log.debug("booked %s, admitted by %s", message.request_id, message.conductor_id)

    async def on_progress(self, progress: RequestProgress, msg: Msg) -> None:
        if progress.kind == "first_token":
            self.scheduler.first_token(progress.request_id, progress.ttft_s)
        else:
            self.scheduler.finished(progress.request_id, progress.num_output_tokens)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(10.0)
            now = self.view.clock()
            # peers' too: a replica that dies leaves its requests to the progress reports, or to this
            for request_id in [r for r, a in self.scheduler.admitted.items() if now - a.admitted_at > ADMITTED_MAX_AGE]:
                self.scheduler.finished(request_id)

    def heartbeat(self) -> Heartbeat:
        beat = super().heartbeat()
        scheduler = self.scheduler
        on_decode = scheduler.policy.prefills_on_decode(scheduler.view)
        beat.payload = ConductorBeat(load=scheduler.num_own, prefills_on_decode=on_decode)
        return beat
