"""/openapi.json: the real request models, the fleet's headers and the typed errors.

The handlers read their bodies themselves (bounded in size, validated
strictly, errors in OpenAI's shape), so FastAPI cannot infer what they take.
This publishes it, from the same pydantic models the handlers validate with,
so schema-driven clients and fuzzers generate real requests.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from fleet.config import CLASSES
from gateway.fleet_api import PrewarmBody
from gateway.messages_map import CountBody, MessagesBody
from gateway.models_api import PromoteBody, RollbackBody
from gateway.request import CHAIN_ID_PATTERN, DEADLINE_PATTERN, MAX_CHAIN_ID, MAX_DEADLINE_MS
from gateway.responses_schema import ResponsesBody
from gateway.schemas import ChatBody, CompletionBody, ErrorBody

REF = "#/components/schemas/{model}"

HEADERS: list[dict[str, Any]] = [
    {"name": "X-Priority", "in": "header", "required": False,
     "description": "The request's class (default: the key's, else the config's default_priority); "
                    "never above the key's max_priority.",
     "schema": {"type": "string", "enum": list(CLASSES)}},
    {"name": "X-Deadline-Ms", "in": "header", "required": False,
     "description": f"Milliseconds from receipt, 1 to {MAX_DEADLINE_MS}, plain digits; a request past its "
                    "deadline never reaches an engine (504).",
     "schema": {"type": "string", "pattern": DEADLINE_PATTERN}},
    {"name": "X-Chain-Id", "in": "header", "required": False,
     "description": "The agent chain this call belongs to, stored with the request; in a fair tier "
                    "its flow, which shares the call's class with the others (docs/fair-line.md).",
     "schema": {"type": "string", "pattern": CHAIN_ID_PATTERN, "maxLength": MAX_CHAIN_ID}},
]

# Why each status can come back; every one has the ErrorBody shape.
WHY = {
    400: "Bad JSON, or a bad X-Priority / X-Deadline-Ms / X-Chain-Id (invalid_json, invalid_priority, ...), or a "
         "Responses field not served or past the store's bounds (unsupported_parameter, conversation_too_large).",
    401: "Missing or unknown API key (invalid_api_key).",
    403: "The key may not use this tier or class, or this endpoint.",
    404: "No such model (model_not_found) or tier, or no such stored response for this key (response_not_found).",
    408: "The request head or body did not arrive in time (request_timeout); the connection is closed.",
    413: "Body over the config's max_body_bytes (body_too_large).",
    422: "A field is missing, of the wrong type or out of bounds (invalid_value); `param` names it.",
    429: "Refused now for capacity, budget or a key's limits (at_capacity); Retry-After says when to retry.",
    431: "Request headers over the config's gateway.max_header_bytes (request_header_fields_too_large).",
    502: "The fleet failed the request (worker_lost, engine_error, upstream_error).",
    503: "The fleet's Redis is away (redis_unavailable); Retry-After.",
    504: "The deadline passed in the line or while running (deadline_exceeded).",
}
CALL_ERRORS = (400, 401, 403, 404, 408, 413, 422, 429, 431, 502, 503, 504)
SECURITY = [{"bearer": []}, {}]  # a key, or none while the gateway runs open


def _errors(statuses: tuple[int, ...]) -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": REF.format(model="ErrorBody")}}}
    out: dict[str, Any] = {str(s): {"description": WHY[s], "content": content} for s in statuses}
    out["default"] = {"description": "Any other error, in the same shape.", "content": content}
    return out


def _body(model: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=model)}}}}


def build(app: FastAPI) -> dict[str, Any]:
    """The document: FastAPI's paths, with bodies, headers, security and errors filled in."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="An OpenAI-compatible gateway and capacity governor for agent fleets.")
    _, defs = models_json_schema([(ChatBody, "validation"), (CompletionBody, "validation"),
                                  (ResponsesBody, "validation"), (MessagesBody, "validation"),
                                  (CountBody, "validation"),
                                  (PrewarmBody, "validation"), (PromoteBody, "validation"),
                                  (RollbackBody, "validation"), (ErrorBody, "serialization")], ref_template=REF)
    comps = doc.setdefault("components", {})
    comps.setdefault("schemas", {}).update(defs["$defs"])
    comps["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "Authorization: Bearer <key> (see `fleet keys add`)."}}
    paths = doc["paths"]
    stream = {"text/event-stream": {"schema": {"type": "string"}}}
    for path, model in (("/v1/chat/completions", "ChatBody"), ("/v1/completions", "CompletionBody")):
        op = paths[path]["post"]
        op.update(requestBody=_body(model), parameters=HEADERS, security=SECURITY)
        op["responses"] = {"200": {"description": "The completion; with `stream: true`, server-sent events "
                                   "ending in `data: [DONE]`.",
                                   "content": {"application/json": {"schema": {"type": "object"}}, **stream}},
                           **_errors(CALL_ERRORS)}
    op = paths["/v1/responses"]["post"]
    op.update(requestBody=_body("ResponsesBody"), parameters=HEADERS, security=SECURITY)
    op["responses"] = {"200": {"description": "The Response; with `stream: true`, the Responses API's server-sent "
                               "events, ending in response.completed, response.incomplete or response.failed.",
                               "content": {"application/json": {"schema": {"type": "object"}}, **stream}},
                       **_errors(CALL_ERRORS)}
    _messages(paths)
    for verb in ("get", "delete"):  # a stored response, to the key that made it (any other: 404)
        op = paths["/v1/responses/{response_id}"][verb]
        op["security"] = SECURITY
        op["responses"] = {"200": {"description": "The stored Response." if verb == "get" else "Deleted.",
                                   "content": {"application/json": {"schema": {"type": "object"}}}},
                           **_errors((401, 404, 503))}
    op = paths["/v1/fleet/prewarm"]["post"]
    op.update(requestBody=_body("PrewarmBody"), security=SECURITY)
    op["responses"] = {"200": {"description": "The order, as stored.",
                               "content": {"application/json": {"schema": {"type": "object"}}}},
                       **_errors((400, 401, 403, 404, 408, 413, 422, 431, 503))}
    for verb, model in (("promote", "PromoteBody"), ("rollback", "RollbackBody")):  # the model registry (admin)
        op = paths[f"/v1/fleet/models/{{tier}}/{verb}"]["post"]
        op.update(requestBody=_body(model), security=SECURITY)
        op["responses"] = {"200": {"description": "The tier's registry record after the change.",
                                   "content": {"application/json": {"schema": {"type": "object"}}}},
                           **_errors((400, 401, 403, 404, 408, 413, 422, 431, 503)),
                           "409": {"description": "Refused now: already_live, no_previous_version.",
                                   "content": {"application/json": {"schema": {"$ref": REF.format(
                                       model="ErrorBody")}}}}}
    status = paths["/v1/fleet/status"]["get"]
    status["security"] = SECURITY
    status["responses"] = {"200": {"description": "Per tier: line, drain, replicas, floor, ceiling, spend.",
                                   "content": {"application/json": {"schema": {"type": "object"}}}},
                           **_errors((401, 403, 503))}
    for path in ("/healthz", "/readyz", "/v1/models"):
        paths[path]["get"]["responses"].update(_errors((503,)) if path == "/readyz" else {})
    return doc


# Anthropic's error shape: {"type": "error", "error": {"type", "message", ...}}; 422 is a 400 there, 503 a 529.
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"],
                   "properties": {"type": {"const": "error"},
                                  "error": {"type": "object", "required": ["type", "message"],
                                            "properties": {"type": {"type": "string"},
                                                           "message": {"type": "string"}}}}}


def _messages(paths: dict[str, Any]) -> None:
    """Anthropic's Messages routes: their bodies, the fleet's headers and errors in Anthropic's shape."""
    content = {"application/json": {"schema": ANTHROPIC_ERROR}}
    errors = {str(s): {"description": WHY[s], "content": content} for s in (400, 401, 403, 404, 408, 413, 429,
                                                                           431, 502, 504)}
    errors["529"] = {"description": "The fleet's Redis is away (overloaded_error, code redis_unavailable).",
                     "content": content}
    errors["default"] = {"description": "Any other error, in the same shape.", "content": content}
    op = paths["/v1/messages"]["post"]
    op.update(requestBody=_body("MessagesBody"), parameters=HEADERS, security=SECURITY)
    op["responses"] = {"200": {"description": "The message; with `stream: true`, Anthropic's server-sent events "
                               "ending in message_stop.",
                               "content": {"application/json": {"schema": {"type": "object"}},
                                           "text/event-stream": {"schema": {"type": "string"}}}}, **errors}
    op = paths["/v1/messages/count_tokens"]["post"]
    op.update(requestBody=_body("CountBody"), security=SECURITY)
    op["responses"] = {"200": {"description": "`{input_tokens}`, as the fleet estimates the prompt for admission.",
                               "content": {"application/json": {"schema": {"type": "object"}}}}, **errors}


def install_openapi(app: FastAPI) -> None:
    """Serve `build`'s document at /openapi.json (made once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
