"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A Messages request is one chat call (`gateway.messages_map.chat_body`), read and counted as the
completion routes read theirs (`gateway.completions.read_call`) and served by the same
`gateway.call.Call`: the same line, admission, classes, deadlines, chains, budgets, fair line,
prefix affinity and retries joined. Only its answer is written differently: whole
(`message_object`), or streamed as Anthropic's events (`gateway.messages_stream`, a render of
the chat stream loop in `gateway.answers`). An engine that speaks Messages itself gets the caller's
body whole beside the chat call (`speaks_messages`): `vllm` answers it with vLLM's own Anthropic
layer, an `openai` upstream on its `/v1/messages`. Every error these routes answer is in Anthropic's
shape (`messages_map.error_body`): 429 `rate_limit_error` with the fleet's retry headers, 529
`overloaded_error` for an unavailable fleet, 400 `invalid_request_error` naming the field.

Claude Code's extras (a `HEAD /` first, `?beta=true`, `anthropic-beta`, `anthropic-version`, `cache_control`,
`output_config`, `context_management`) are accepted and have no effect.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from redis.exceptions import RedisError

from fleet.config import TierConfig
from fleet.engine_config import ANTHROPIC_BODY, EngineName
from fleet.prompt_size import estimate_prompt_tokens
from fleet.store.events import Chunk, Done
from gateway.answers import stream
from gateway.answers import whole as answer_whole
from gateway.auth import Caller, authenticate
from gateway.call import Call
from gateway.call_spec import CallSpec, parse_call
from gateway.client_watch import ClientGone, ClientWatch
from gateway.completions import read_call
from gateway.errors import APIError
from gateway.messages_map import (
    CountBody,
    MessagesBody,
    chat_body,
    content_blocks,
    error_body,
    error_status,
    message_object,
    new_id,
)
from gateway.messages_stream import MessagesRender, head_of
from gateway.redis_loss import unavailable_error
from gateway.request import read_json, validate
from gateway.state import Gateway

log = logging.getLogger("fleet.gateway")
router = APIRouter()


def anthropic_error(err: APIError) -> Response:
    """An error in Anthropic's shape, with the fleet's headers (Retry-After, retry-after-ms, x-should-retry)."""
    return Response(orjson.dumps(error_body(err)), status_code=error_status(err), media_type="application/json",
                    headers=err.headers)


async def answered(handler: Callable[[], Awaitable[Response]]) -> Response:
    """`handler`'s answer, its errors (the fleet's, Redis's) in Anthropic's shape."""
    try:
        return await handler()
    except APIError as e:
        return anthropic_error(e)
    except RedisError as e:
        log.error("Redis unavailable: %s", e)
        return anthropic_error(unavailable_error(e))


@router.head("/", include_in_schema=False)
async def preconnect() -> Response:
    """Claude Code's `HEAD /` before its first call (it warms the connection): answered, not a 404."""
    return Response(status_code=200)


@router.post("/v1/messages")
async def create(request: Request) -> Response:
    return await answered(lambda: _create(request))


async def _create(request: Request) -> Response:
    gw: Gateway = request.app.state.gw
    bodies: list[MessagesBody] = []

    async def parse(caller: Caller, raw: bytes, data: Any) -> CallSpec:
        body, spec = read_messages(gw, data)
        bodies.append(body)
        return spec

    caller, spec, headers = await read_call(request, "chat", gw.cfg, parse)
    body, msg_id = bodies[0], new_id("msg")
    try:
        async with Call(gw, spec, caller, headers, ClientWatch(request.receive)) as call:
            first = await call.first()
            if spec.stream:
                head = head_of(msg_id, call.model_named(body.model), spec.prompt_tokens)
                return stream(call, first, MessagesRender(head, body.stop_sequences))
            return await whole(call, first, body, msg_id)
    except ClientGone:  # ended as cancelled; nobody reads this
        return Response(status_code=499)


def read_messages(gw: Gateway, data: Any) -> tuple[MessagesBody, CallSpec]:
    """The Messages body and the chat call it runs as; max_tokens past the tier's limit is cut to
    it (Claude Code asks 32000 of any model: a bound, not a demand)."""
    body: MessagesBody = validate(MessagesBody, data)
    tier = gw.cfg.resolve_model(body.model)
    limit = gw.cfg.tiers[tier].max_tokens_limit if tier is not None else body.max_tokens
    engine = gw.cfg.tiers[tier].engine if tier is not None else "sim"
    chat = chat_body(body, engine, min(body.max_tokens, limit))
    if tier is not None and speaks_messages(gw.cfg.tiers[tier]):
        chat[ANTHROPIC_BODY] = data  # the engine speaks Messages: it gets the caller's body whole
    try:
        return body, parse_call("chat", orjson.dumps(chat), chat, gw.cfg, from_messages=True)
    except APIError as e:  # the chat call's names for what the caller sent under Anthropic's
        if e.param is not None:
            e.param = {"stop": "stop_sequences", "user": "metadata.user_id"}.get(e.param, e.param)
        raise


def speaks_messages(tier: TierConfig) -> bool:
    """Whether the tier's engine answers Messages itself: `vllm` by vLLM's own Anthropic layer
    (`workers.engines.vllm_messages`), `openai` when its upstream speaks `/v1/messages`."""
    if tier.engine == EngineName.VLLM:
        return True
    return tier.engine == EngineName.OPENAI and tier.openai.upstream_api == "messages"


async def whole(call: Call, first: Done | Chunk, body: MessagesBody, msg_id: str) -> Response:
    """A Messages call answered whole: the message (the answer ends the call: `gateway.answers.whole`)."""

    async def make(call: Call, done: Done) -> Response:
        content = content_blocks((done.choice or {}).get("message") or {})
        message = message_object(msg_id, done.model or call.model_named(body.model), content, done,
                                 body.stop_sequences)
        return Response(orjson.dumps(message), media_type="application/json", headers=call.headers)

    return await answer_whole(call, first, make)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    return await answered(lambda: _count(request))


async def _count(request: Request) -> Response:
    """The prompt's tokens as the fleet estimates them for admission (`fleet.prompt_size`)."""
    gw: Gateway = request.app.state.gw
    caller = authenticate(request)
    _, data = await read_json(request, gw.cfg.max_body_bytes)
    body: CountBody = validate(CountBody, data)
    tier = gw.cfg.resolve_model(body.model)
    if tier is None:
        raise APIError(404, f"model {body.model!r} does not exist; GET /v1/models lists the tiers",
                       param="model", code="model_not_found")
    caller.check_tier(tier)
    chat = chat_body(body, gw.cfg.tiers[tier].engine)
    return Response(orjson.dumps({"input_tokens": estimate_prompt_tokens("chat", chat)}),
                    media_type="application/json")
