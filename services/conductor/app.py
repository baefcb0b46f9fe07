"""The conductor service: keeps the cluster view from heartbeats and answers
admission requests with a (prefill, decode) pair or a reason to refuse."""

from contextlib import AsyncExitStack
from dataclasses import dataclass

from nats.aio.msg import Msg

from libs.common import subjects
from libs.common.schema import AdmitReply, AdmitRequest, ErrorInfo, Heartbeat
from libs.common.service import Service
from libs.common.settings import ServiceSettings
from services.conductor.cluster import ClusterView
from services.conductor.policies import POLICIES


@dataclass(frozen=True)
class ConductorSettings:
    service: ServiceSettings
    instance_timeout: float = 3.0
    policy: str = "least_loaded"

    def __post_init__(self) -> None:
        if self.instance_timeout <= 0:
            raise ValueError("instance timeout must be positive")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {sorted(POLICIES)}")


class Conductor(Service):
    def __init__(self, settings: ConductorSettings) -> None:
        super().__init__(settings.service)
        self.view = ClusterView(timeout=settings.instance_timeout)
        self.policy = POLICIES[settings.policy]()
        self.admitted = 0
        self.refused = 0

    async def start(self, stack: AsyncExitStack) -> None:
        await self.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await self.subscribe(subjects.CONDUCTOR_ADMIT, AdmitRequest, self.on_admit, queue=subjects.CONDUCTOR_QUEUE)

    async def on_heartbeat(self, heartbeat: Heartbeat, msg: Msg) -> None:
        self.view.observe(heartbeat)

    async def on_admit(self, request: AdmitRequest, msg: Msg) -> AdmitReply:
        decision = self.policy.choose(request, self.view)
        if not decision.admitted:
            self.refused += 1
            self.log.warning("refused %s: %s", request.request_id, decision.error_message)
            return AdmitReply(error=ErrorInfo(code=decision.error_code, message=decision.error_message))
        self.admitted += 1
        self.view.assigned(decision.prefill_id)
        self.view.assigned(decision.decode_id)
        return AdmitReply(prefill_id=decision.prefill_id, decode_id=decision.decode_id)
