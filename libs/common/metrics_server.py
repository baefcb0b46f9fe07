"""Every service's own HTTP endpoint for Prometheus and probes: ``GET /metrics`` (the
process's metrics, Prometheus text) and ``GET /healthz`` (200 while the service runs
and is connected to NATS, 503 with the reasons otherwise).

It serves no secret and changes nothing: it binds 127.0.0.1 unless told otherwise
(KVSERVE_METRICS_HOST), and it is off unless KVSERVE_METRICS_PORT is set.
"""

from collections.abc import Callable

import msgspec
from aiohttp import web

from libs.common.metrics import CONTENT_TYPE, Metrics
from libs.protocol.ids import InstanceId

HealthCheck = Callable[[], list[str]]  # why the service is not healthy now; [] when it is

METRICS = web.AppKey("metrics", Metrics)
HEALTH = web.AppKey("health", HealthCheck)
INSTANCE = web.AppKey("instance", str)


def init_app(metrics: Metrics, health: HealthCheck, instance_id: InstanceId) -> web.Application:
    app = web.Application()
    app[METRICS], app[HEALTH], app[INSTANCE] = metrics, health, instance_id
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    return app


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Listen on ``host``:``port`` (0: any free port); the runner and the base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].exposition().encode()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _healthz(request: web.Request) -> web.Response:
    reasons = request.app[HEALTH]()
    body = {"status": "unavailable" if reasons else "ok", "instance_id": request.app[INSTANCE]}
    if reasons:
        body["reasons"] = reasons
    return web.Response(body=msgspec.json.encode(body), status=503 if reasons else 200, content_type="application/json")
