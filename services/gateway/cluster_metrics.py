"""The whole cluster's metrics, as /metrics serves them: this process's own and
every live instance's, asked over NATS, merged into one exposition (each metric
once, its samples from every instance, told apart by their ``instance`` label)."""

import asyncio

from libs.common.metrics import merge_expositions
from libs.common.peers import PeerDirectory
from libs.common.service import Service
from libs.protocol import subjects
from libs.protocol.ids import InstanceId
from libs.protocol.schema import ErrorReply, MetricsReply, MetricsRequest
from libs.protocol.vocabulary import Role

ROLES = (Role.CONDUCTOR, Role.STORE, Role.PREFILL, Role.DECODE, Role.GATEWAY)
METRICS_TIMEOUT = 2.0  # seconds an instance has to answer


async def cluster_metrics(service: Service, peers: PeerDirectory) -> str:
    """Every live instance's metrics (asked in parallel) in the Prometheus text format."""
    others = [hb.instance_id for role in ROLES for hb in peers.alive(role) if hb.instance_id != service.instance_id]

    async def ask(instance_id: InstanceId) -> str:
        try:
            reply = await service.request(
                subjects.metrics(instance_id), MetricsRequest(), MetricsReply, timeout=METRICS_TIMEOUT
            )
        except Exception as e:  # one silent instance must not hide the others
            service.log.warning("no metrics from %s: %s", instance_id, e)
            return ""
        if isinstance(reply, ErrorReply):
            service.log.warning("no metrics from %s: %s", instance_id, reply.message)
            return ""
        return reply.text

    texts = dict(zip(others, await asyncio.gather(*(ask(i) for i in others))))
    return merge_expositions({service.instance_id: service.metrics.exposition(), **texts})
