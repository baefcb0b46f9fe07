"""The gateway's HTTP application: every endpoint, the middlewares in front of
them, and the typed keys of what the application holds.

An HTTP endpoint goes here (one ``add_*`` line in `init_app`) with its handler in
handlers.py, and in openapi.py's description. The application owns no resource
of its own: the model, NATS and the listener live and die with the Gateway (app.py).
"""

from aiohttp import web

from libs.common.service import Service
from services.gateway import console
from services.gateway.generation import Generations
from services.gateway.handlers import Handlers, error_middleware
from services.gateway.listener import ConnectionGuard
from services.gateway.request_limits import MAX_BODY_BYTES

GATEWAY = web.AppKey("gateway", Service)  # the gateway's NATS side: its instance, its connection
GENERATIONS = web.AppKey("generations", Generations)  # the request core


def init_app(service: Service, generations: Generations, guard: ConnectionGuard | None = None) -> web.Application:
    """The gateway's routes; ``guard``, when given, watches every request first."""
    handlers = Handlers(service, generations)
    middlewares = [error_middleware, handlers.auth_middleware]
    app = web.Application(middlewares=([guard.middleware] if guard else []) + middlewares,
                          client_max_size=MAX_BODY_BYTES)  # fmt: skip
    app[GATEWAY] = service
    app[GENERATIONS] = generations
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model}", handlers.get_model)
    app.router.add_get("/v1/usage", handlers.usage)  # the caller's own tenant's
    app.router.add_get("/health", handlers.health_ready)  # vLLM's meaning: 200 only when requests can be served
    app.router.add_get("/health/ready", handlers.health_ready)
    app.router.add_get("/health/live", handlers.health_live)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/openapi.json", handlers.openapi)
    console.add_routes(app, service, generations)  # /console: the page, its data and live feed
    return app
