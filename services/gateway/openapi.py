"""The gateway's OpenAPI 3.1 description (GET /openapi.json), written out by hand: its
operations here, the schemas they refer to in `openapi_schemas.py`.
"""

from functools import cache
from typing import Any

import msgspec

from services.gateway.openapi_schemas import Schema, ref, schemas, usage_schema

_STATUS_TEXT = {
    400: "The request is invalid; `param` names the field.",
    401: "No API key, or the wrong one.",
    403: "The API key's tenant is disabled.",
    404: "The model is not served here.",
    408: "The request body did not arrive within the body timeout.",
    413: "The request body is larger than the server accepts (1 MiB, once its Content-Encoding is undone).",
    415: "The request body's Content-Encoding is neither gzip, deflate nor identity.",
    429: "The cluster cannot meet the request's latency targets now, or the tenant is over a quota (`reason` "
         "names it; Retry-After says when to retry; the x-ratelimit-* headers give the tenant's per-minute limits).",
    500: "A worker failed while serving the request.",
    503: "A role the request needs (conductor, prefill, decode) is missing or unreachable.",
    504: "No token arrived within the request timeout.",
}


def _errors(*statuses: int) -> dict[str, Schema]:
    return {
        str(status): {"description": _STATUS_TEXT[status], "content": {"application/json": {"schema": ref("Error")}}}
        for status in statuses
    }


def _json(description: str, schema: Schema) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _generation(summary: str, request: str, response: str, chunk_object: str) -> Schema:
    slo_headers = [
        {
            "name": name,
            "in": "header",
            "required": False,
            "description": f"This request's {target} target in milliseconds, overriding the conductor's.",
            "schema": {"type": "number", "exclusiveMinimum": 0},
        }
        for name, target in (("x-kvserve-slo-ttft-ms", "time-to-first-token"),
                             ("x-kvserve-slo-tbt-ms", "time-between-tokens"))
    ]  # fmt: skip
    stream = {  # one event (OpenAPI 3.2's reading of an event stream's schema)
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string"}},
        "description": f"With stream: true, Server-Sent Events: one `data: <{chunk_object} JSON>` event per chunk, "
        "then `data: [DONE]`.",
    }
    return {
        "summary": summary,
        "parameters": slo_headers,
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
        "responses": {
            "200": {
                "description": "The completion, whole or streamed.",
                "content": {"application/json": {"schema": ref(response)}, "text/event-stream": {"schema": stream}},
            },
            **_errors(400, 401, 403, 404, 408, 413, 415, 429, 500, 503, 504),
        },
    }


def _health(summary: str, ready: bool) -> Schema:
    responses = {"200": _json("Serving.", ref("Health"))}
    if ready:
        responses["503"] = _json("Not ready: `reasons` says why.", ref("Health"))
    return {"summary": summary, "security": [], "responses": responses}


def _console_paths() -> dict[str, Schema]:
    """The live console (console.py): a public page and its files, and the data they show."""
    public = {"security": []}
    not_found = {"404": {"description": "No such file.", "content": {"application/json": {"schema": ref("Error")}}}}
    return {
        "/console": {"get": {"summary": "The live console (an HTML page).", **public,
                             "responses": {"200": {"description": "The page.", "content": {"text/html": {}}}}}},
        "/console/static/{name}": {"get": {
            "summary": "A file of the console page (script, style sheet, the vendored chart library).", **public,
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "The file.", "content": {"*/*": {}}}, **not_found},
        }},
        "/console/api/state": {"get": {
            "summary": "What the console shows: instances, KV map, routing decisions, requests, SLO attainment, "
                       "tenants (every tenant for an admin's key, the caller's own otherwise).",
            "responses": {"200": _json("The cluster's state.", {"type": "object"}), **_errors(401)},
        }},
        "/console/api/events": {"get": {
            "summary": "The same state as server-sent events, one a second (send Accept: text/event-stream).",
            "responses": {
                "200": {"description": "The event stream.", "content": {"text/event-stream": {}}},
                "406": {"description": "The request did not ask for an event stream.",
                        "content": {"application/json": {"schema": ref("Error")}}},
                **_errors(401),
            },
        }},
    }  # fmt: skip


def document(model_id: str, needs_api_key: bool) -> dict[str, Any]:
    ready = "Ready: connected to NATS with a live conductor, prefill and decode instance (vLLM's /health)."
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvserve",
            "version": "0.1.0",
            "description": "An OpenAI-compatible API in front of a disaggregated LLM serving cluster.",
        },
        "security": [{"bearer": []}] if needs_api_key else [],
        "paths": {
            "/v1/chat/completions": {
                "post": _generation("Create a chat completion.", "ChatCompletionRequest", "ChatCompletion",
                                    "chat.completion.chunk"),  # fmt: skip
            },
            "/v1/completions": {
                "post": _generation("Create a text completion.", "CompletionRequest", "Completion",
                                    "text_completion"),  # fmt: skip
            },
            "/v1/models": {
                "get": {"summary": "List the served model.",
                        "responses": {"200": _json("The model list.", ref("ModelList")), **_errors(401)}},
            },  # fmt: skip
            "/v1/models/{model}": {
                "get": {
                    "summary": "Describe one model.",
                    "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"enum": [model_id]}}],
                    "responses": {"200": _json("The model.", ref("Model")), **_errors(401, 404)},
                },
            },
            "/v1/usage": {
                "get": {
                    "summary": "What the caller's own tenant used of this gateway since it started, and its limits.",
                    "responses": {"200": _json("The tenant's usage.", usage_schema()), **_errors(401, 403)},
                },
            },
            "/health": {"get": _health(ready, ready=True)},
            "/health/ready": {"get": _health(ready, ready=True)},
            "/health/live": {"get": _health("Live: the process serves HTTP.", ready=False)},
            "/metrics": {
                "get": {
                    "summary": "Every instance's metrics in the Prometheus text format, labelled by instance.",
                    "responses": {
                        "200": {"description": "The metrics.",
                                "content": {"text/plain": {"schema": {"type": "string"}}}},  # fmt: skip
                        **_errors(401),
                    },
                },
            },
            **_console_paths(),
            "/openapi.json": {
                "get": {
                    "summary": "This description.",
                    "security": [],
                    "responses": {"200": _json("The OpenAPI 3.1 document.", {"type": "object"})},
                },
            },
        },
        "components": {
            "schemas": schemas(model_id),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "Needed when the gateway has an API key."}
            },
        },
    }


@cache
def document_bytes(model_id: str, needs_api_key: bool) -> bytes:
    return msgspec.json.encode(document(model_id, needs_api_key))
